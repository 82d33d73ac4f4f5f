#!/bin/sh
# Add Arbor to the desktop's application menu: run this once from the unpacked bundle folder
# (double-click it, or `sh install-desktop-entry.sh`). It writes
#   ${XDG_DATA_HOME:-~/.local/share}/applications/arbor.desktop   (Exec = this folder's arbor)
#   ${XDG_DATA_HOME:-~/.local/share}/icons/hicolor/256x256/apps/arbor.png
# Moved the folder? Run it again. Remove both files to take Arbor out of the menu.
set -eu
here=$(cd "$(dirname "$0")" && pwd -P)
data=${XDG_DATA_HOME:-$HOME/.local/share}
apps=$data/applications
icons=$data/icons/hicolor/256x256/apps
[ -x "$here/arbor" ] || { echo "install-desktop-entry.sh: no arbor program next to this script" >&2; exit 1; }

# The Desktop Entry spec's Exec quoting: the path in double quotes with \ " ` $ escaped by a
# backslash; then, as any string value, every backslash doubled; and % written as %%.
quoted=$(printf '%s' "$here/arbor" | sed -e 's/[\\"`$]/\\&/g' -e 's/\\/\\\\/g' -e 's/%/%%/g')

mkdir -p "$apps" "$icons"
cp "$here/_internal/icons/arbor-256.png" "$icons/arbor.png"
tmp="$apps/.arbor.desktop.$$"
while IFS= read -r line || [ -n "$line" ]; do
  case $line in
    Exec=*) printf 'Exec="%s"\n' "$quoted" ;;
    *) printf '%s\n' "$line" ;;
  esac
done < "$here/arbor.desktop" > "$tmp"
chmod 644 "$tmp"
mv "$tmp" "$apps/arbor.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$apps" || true
echo "Arbor is in the application menu: $apps/arbor.desktop"
