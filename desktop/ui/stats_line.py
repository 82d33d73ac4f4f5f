"""A reply's statistics in plain words: one short line under the reply, the details in its
tooltip.

The line, e.g. ``1.20 s to first token (0.95 s waiting) · 38.5 tok/s · 57 tokens · 190 of 206
prompt tokens reused: 120 in memory, 70 from disk · drafts: 23 of 33 accepted``:

* time to first token counts from the user's send; the wait behind other work (another chat's
  reply, a title) is named apart;
* every reused prompt token is attributed to where its state came from (the engine's
  ``cached_by_tier``: tokens still in the live caches and those restored from device memory
  count as "in memory"; host memory and disk are named);
* drafting is one phrase; the drafter, per-round and per-position acceptance are in the tooltip.

Stored statistics may come from older versions of Arbor (no tiers, no wait): what is missing is
left out, and reused tokens no tier accounts for are "from the cache".
"""

from __future__ import annotations

from typing import Any

#: The prefix cache's sources, as the line names them (several may share a name).
SOURCE_WORDS = {"live": "in memory", "device": "in memory", "host": "from host memory",
                "disk": "from disk"}
#: The same sources in the tooltip, one each.
SOURCE_DETAIL = {"live": "still loaded", "device": "from device memory",
                 "host": "from host memory", "disk": "from disk"}
DRAFTERS = {"model": "the draft model", "lookup": "prompt lookup",
            "mtp": "the multi-token-prediction head"}
#: A wait shorter than this is not worth naming.
MIN_WAIT_S = 0.05


def _count(stats: dict[str, Any], key: str) -> int:
    value = stats.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def cached_sources(stats: dict[str, Any]) -> list[tuple[str, int]]:
    """Reused prompt tokens by source, in ``SOURCE_DETAIL`` order, with what no source
    accounts for as ``"cache"`` (statistics stored before sources were recorded)."""
    tiers = stats.get("cached_by_tier") or {}
    sources = [(name, int(tiers.get(name) or 0)) for name in SOURCE_DETAIL]
    sources = [(name, n) for name, n in sources if n > 0]
    rest = _count(stats, "cached_tokens") - sum(n for _, n in sources)
    if rest > 0:
        sources.append(("cache", rest))
    return sources


def format_stats(stats: dict[str, Any] | None) -> str:
    """The line under a reply (see the module docstring); "" without statistics."""
    if not stats:
        return ""
    parts = []
    generated = _count(stats, "generated_tokens")
    if generated:
        first = f"{stats.get('ttft_s', 0.0):.2f} s to first token"
        if (stats.get("queue_s") or 0.0) >= MIN_WAIT_S:
            first += f" ({stats['queue_s']:.2f} s waiting)"
        parts.append(first)
        if stats.get("decode_tps"):
            parts.append(f"{stats['decode_tps']:.1f} tok/s")
        parts.append(f"{generated} token" + ("s" if generated != 1 else ""))
    if stats.get("prompt_tokens") is not None:
        parts.append(_prompt(stats))
    dropped = _count(stats, "dropped_messages")
    if dropped:
        parts.append(f"{dropped} older message{'s' if dropped != 1 else ''} left out")
    drafted = _count(stats, "drafted_tokens")
    if drafted:
        parts.append(f"drafts: {_count(stats, 'accepted_tokens')} of {drafted} accepted")
    return " · ".join(parts)


def _prompt(stats: dict[str, Any]) -> str:
    prompt, cached = _count(stats, "prompt_tokens"), _count(stats, "cached_tokens")
    if not cached:
        return f"{prompt} prompt tokens"
    merged: dict[str, int] = {}
    for name, n in cached_sources(stats):
        words = SOURCE_WORDS.get(name, "from the cache")
        merged[words] = merged.get(words, 0) + n
    where = ", ".join(f"{n} {words}" for words, n in merged.items())
    return f"{cached} of {prompt} prompt tokens reused" + (f": {where}" if where else "")


def stats_tooltip(stats: dict[str, Any] | None) -> str:
    """Every figure of the line, spelled out, plus the drafting details (several lines)."""
    if not stats:
        return ""
    lines = []
    generated = _count(stats, "generated_tokens")
    if generated:
        wait = stats.get("queue_s") or 0.0
        line = f"First token {stats.get('ttft_s', 0.0):.2f} s after sending"
        if wait >= MIN_WAIT_S:
            line += f" ({wait:.2f} s waiting for the model to finish other work)"
        lines.append(line)
    if stats.get("prompt_tokens") is not None:
        prompt, cached = _count(stats, "prompt_tokens"), _count(stats, "cached_tokens")
        line = f"Prompt: {prompt} tokens"
        if cached:
            sources = ", ".join(f"{n} {SOURCE_DETAIL.get(name, 'from the cache')}"
                                for name, n in cached_sources(stats))
            line += f", {cached} reused ({sources})"
            if stats.get("restore_s"):
                line += f", restored in {stats['restore_s']:.2f} s"
        if prompt - cached > 0 and stats.get("prefill_tps"):
            line += f"; {prompt - cached} read at {stats['prefill_tps']:.0f} tok/s"
        lines.append(line)
    dropped = _count(stats, "dropped_messages")
    if dropped:
        lines.append(f"{dropped} older messages were left out to fit the model's context")
    if generated:
        line = f"Reply: {generated} tokens"
        if stats.get("decode_tps"):
            line += f" at {stats['decode_tps']:.1f} tok/s"
        if stats.get("finish_reason") == "length":
            line += ", stopped at the reply's token limit"
        lines.append(line)
    drafted = _count(stats, "drafted_tokens")
    if drafted:
        accepted = _count(stats, "accepted_tokens")
        drafter = stats.get("drafter") or ""
        line = (f"Drafting{' by ' + DRAFTERS.get(drafter, drafter) if drafter else ''}: "
                f"{accepted} of {drafted} drafts accepted ({100.0 * accepted / drafted:.0f}%)")
        if stats.get("mean_accepted") is not None:
            line += f", {stats['mean_accepted']:.2f} per round"
        if stats.get("acceptance_by_position"):
            rates = "/".join(f"{100.0 * rate:.0f}" for rate in stats["acceptance_by_position"])
            line += f"; by position {rates}%"
        lines.append(line + " (drafting changes the speed, never the reply)")
    return "\n".join(lines)
