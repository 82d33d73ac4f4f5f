"""The ``arbor`` command: the app, terminal chat, one-shot generation, model store, benchmarks.

    arbor                       open the app (terminal chat when there is no display)
    arbor chat [--model M]      terminal chat with history
    arbor serve [--model M] [--host H] [--port P] [--api-key K]   OpenAI-compatible server
    arbor generate ...          one generation; --json prints one machine-readable object
    arbor models list [--verbose] | import PATH [--name N] [--quantize 4|8] [--draft D [--quantize-draft 4|8]]
                | rm NAME | unpair NAME
    arbor bench [--model M] [--against mlx-lm] [--formats float32,bfloat16,4bit] [--hybrid [F,..]]
                [--glm]
    arbor bench cache | spec | batch | gguf --model FILE.gguf   the other suites

Every user-caused problem (bad file, unknown architecture, prompt too long, bad arguments) is
printed as one line ``arbor: error: ...`` with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from desktop.version import app_version

if TYPE_CHECKING:
    from backend.memory.budgets import CacheConfig

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is already 2
        self.exit(EXIT_USAGE, f"arbor: error: {message}\n")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="store name, Hugging Face folder or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--exact-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill in 64-token chunks through the row-invariant kernels, so a "
                   "reply from a cached prefix equals a cold start's bit for bit and a long "
                   "prompt is fed between other replies' tokens instead of holding them for "
                   "a 2048-token chunk (default: on for float32 models, where it costs "
                   "nothing; quantized ones prefill 1.5-1.7x slower so: `arbor bench` prints "
                   "it; bench batch and cache pass the flag to the server)")


def _draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (the reply is the model's own either way)."""
    group = p.add_argument_group("speculative decoding (never changes the reply)")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--draft", metavar="M", help="draft model (store name, folder or .gguf) "
                        "with the model's vocabulary")
    choice.add_argument("--draft-lookup", action="store_true",
                        help="draft from the prompt's own n-grams (the default without --draft)")
    choice.add_argument("--no-draft", action="store_true", help="plain decoding")
    group.add_argument("--draft-depth", type=int, metavar="N",
                       help="draft exactly N tokens per round (default: chosen each round)")


def _engine(args: argparse.Namespace, cache=None, max_batch: int = 1):
    """The engine the model, dtype, cache and draft flags ask for."""
    from backend.engine import Engine

    speculation = "none" if args.no_draft else "lookup" if args.draft_lookup else "auto"
    return Engine.load(args.model, args.dtype, cache=cache, draft=args.draft,
                       speculation=speculation, draft_depth=args.draft_depth,
                       max_batch=max_batch, exact_prefill=getattr(args, "exact_prefill", None))


def _positive(text: str) -> int:
    if not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _mib(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    if not (text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return int(text)


def _cache_args(p: argparse.ArgumentParser) -> None:
    """The prefix cache's byte budgets, with this machine's defaults in --help."""
    from backend.memory.budgets import MIB, CacheConfig

    defaults = CacheConfig.default().budgets
    group = p.add_argument_group("prefix cache (shared by all conversations; 0 turns a tier off)")
    for tier, default in (("device", defaults.device_bytes), ("host", defaults.host_bytes),
                          ("disk", defaults.disk_bytes)):
        group.add_argument(f"--cache-{tier}-mb", type=_mib, metavar="N",
                           help=f"{tier} tier budget in MiB (default here: {default // MIB})")
    group.add_argument("--no-disk-cache", action="store_true",
                       help="keep cached prefixes in memory only (same as --cache-disk-mb 0)")


def _cache_config(args: argparse.Namespace) -> CacheConfig:
    """The ``CacheConfig`` that ``_cache_args`` flags ask for (the machine's defaults else)."""
    from dataclasses import replace

    from backend.memory.budgets import CacheConfig

    disk = 0 if args.no_disk_cache else args.cache_disk_mb
    config = CacheConfig.default(device_mb=args.cache_device_mb, host_mb=args.cache_host_mb,
                                 disk_mb=disk)
    # No disk budget: no disk tier at all (nothing read from or written to the cache dir).
    return replace(config, directory=None) if config.budgets.disk_bytes == 0 else config


def _sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="arbor", description="Local LLM chat on MLX.")
    parser.add_argument("--version", action="version", version=f"arbor {app_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    app = sub.add_parser("app", help="open the desktop app")
    _model_args(app)
    app.add_argument("--smoke", action="store_true", help="open the window (any Qt platform, "
                     "offscreen too), reply once, close; print timings as JSON (desktop/smoke.py)")

    chat = sub.add_parser("chat", help="terminal chat")
    _model_args(chat)
    _draft_args(chat)
    _sampling_args(chat, temperature=0.7)
    _cache_args(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, "
                           "/v1/completions, /v1/models)")
    _model_args(serve)
    _draft_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only; "
                       "any other address needs --api-key)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default: 8000; 0 picks a "
                       "free one and prints it)")
    serve.add_argument("--api-key", default=os.environ.get("ARBOR_API_KEY") or None,
                       metavar="KEY", help="require 'Authorization: Bearer KEY' on every "
                       "request (default: $ARBOR_API_KEY)")
    from backend.batch_default import MOST, ROWS_PER_CORE, default_max_batch

    serve.add_argument("--max-batch", type=_positive, metavar="N",
                       help=f"most requests generating at once, in one batched step each; "
                       f"the rest wait in arrival order (default: {ROWS_PER_CORE} per core, "
                       f"here {default_max_batch(gpu=False)}; {MOST} on a GPU)")
    _cache_args(serve)

    gen = sub.add_parser("generate", help="generate once and exit")
    _model_args(gen)
    _draft_args(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="user message (rendered with the chat template)")
    source.add_argument("--prompt-ids", help="raw token ids, comma separated (no template)")
    source.add_argument("--messages", type=Path, help="JSON file with a list of messages")
    _sampling_args(gen, temperature=0.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    models = sub.add_parser("models", help="the local model store")
    msub = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    listing = msub.add_parser("list")
    listing.add_argument("--verbose", action="store_true",
                         help="also the cache bytes each token of a conversation takes")
    imp = msub.add_parser("import")
    imp.add_argument("path", type=Path)
    imp.add_argument("--name")
    imp.add_argument("--quantize", type=int, choices=(4, 8))
    imp.add_argument("--draft", metavar="DRAFT", help="pair a draft model for speculative "
                     "decoding: a stored name, or a folder or .gguf file to import too (same "
                     "vocabulary); generate, chat, serve and the app then draft with it")
    imp.add_argument("--quantize-draft", type=int, choices=(4, 8),
                     help="quantize the draft as it is imported")
    rm = msub.add_parser("rm", help="remove a model (not while it is another's paired draft)")
    rm.add_argument("name")
    unpair = msub.add_parser("unpair", help="forget a model's paired draft (both stay)")
    unpair.add_argument("name")

    bench = sub.add_parser("bench", help="benchmarks against mlx-lm on the same weights")
    bench.add_argument("suite", nargs="?", choices=BENCH_SUITES, default="speed",
                       help="speed: prefill/decode per weight format; cache: many conversations "
                       "round-robin against arbor serve and mlx-lm's server, then a restart; "
                       "spec: plain vs speculative decoding (prompt lookup, a 4-bit self draft), "
                       "and a random Gemma 4 assistant's draft and verify costs, "
                       "then one round of the Qwen3.5 MTP head and a DFlash block drafter "
                       "against a plain step (random checkpoint, --drafter-size); "
                       "batch: 1..16 clients streaming at once against arbor serve and mlx-lm's "
                       "server, a long prompt arriving mid-stream, step cost per batch size; "
                       "gguf: a .gguf --model imported with its quantized tensors kept vs as "
                       "float16 (bytes on disk, decode speed)")
    _model_args(bench)
    bench.add_argument("--against", choices=("mlx-lm", "none"), default="mlx-lm")
    bench.add_argument("--formats", default="float32,bfloat16,4bit")
    bench.add_argument("--prompt-tokens", type=int, default=512)
    bench.add_argument("--new-tokens", type=int,
                       help="tokens per reply (default: speed 128, cache 48, spec 128, "
                       "gguf 128)")
    bench.add_argument("--hybrid", nargs="?", const="qwen3_next", metavar="FAMILIES",
                       help="also benchmark random checkpoints of newer families against "
                       "mlx-lm: comma-separated families among qwen3_next (alone, the "
                       "default), qwen3_5, qwen3_5_moe, gemma4, gemma4_moe, or all")
    bench.add_argument("--glm", action="store_true",
                       help="also benchmark a random GLM-4.7-Flash-shaped checkpoint (latent "
                       "attention, group-limited MoE) against mlx-lm")
    spec = bench.add_argument_group("bench spec")
    spec.add_argument("--drafter-size", default="1024x8", metavar="HIDDENxLAYERS",
                      help="width and depth of the random Qwen3.5-shaped checkpoint the "
                      "checkpoint drafters' rounds are timed on (0 leaves them out)")
    spec.add_argument("--assistant-size", default="1536x10", metavar="HIDDENxLAYERS",
                      help="width and depth of the random Gemma 4 E2B-shaped target the "
                      "assistant drafter is timed against (0 leaves it out)")
    batch = bench.add_argument_group("bench batch")
    batch.add_argument("--clients", default="1,2,4,8,16",
                       help="concurrent client counts, comma separated")
    batch.add_argument("--batch-formats", default="float32,4bit",
                       help="weight formats for bench batch")
    trace = bench.add_argument_group("bench cache")
    trace.add_argument("--conversations", type=int, default=40)
    trace.add_argument("--turns", type=int, default=6)
    trace.add_argument("--system-tokens", type=int, default=1100)
    trace.add_argument("--mlx-lm-cache-sizes", default="10",
                       help="mlx-lm prompt-cache entries per run, comma separated")
    trace.add_argument("--with-defaults", action="store_true",
                       help="also run arbor serve with this machine's default budgets")
    _cache_args(bench)
    return parser


# -- commands ----------------------------------------------------------------------------------
def _request(args: argparse.Namespace, messages: list[dict] | None = None,
             prompt_ids: list[int] | None = None):
    from backend.api import GenerateRequest, SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed)
    return GenerateRequest(messages=messages, prompt_ids=prompt_ids, sampling=sampling,
                           max_tokens=args.max_tokens, stop=tuple(args.stop))


def _messages_from_file(path: Path) -> list[dict]:
    from backend.errors import InvalidRequestError

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"{path}: cannot read messages ({exc})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list):
        raise InvalidRequestError(f"{path}: expected a JSON list of messages")
    return data


def _parse_ids(text: str) -> list[int]:
    from backend.errors import InvalidRequestError

    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise InvalidRequestError(f"--prompt-ids must be comma-separated integers: {text!r}") \
            from None


def cmd_generate(args: argparse.Namespace) -> int:
    from backend.api import DoneEvent

    prompt_ids = messages = None
    if args.prompt_ids is not None:
        prompt_ids = _parse_ids(args.prompt_ids)
    else:
        messages = (_messages_from_file(args.messages) if args.messages
                    else [{"role": "user", "content": args.prompt}])
        if args.system:
            messages = [{"role": "system", "content": args.system}] + messages
    engine = _engine(args)
    done = None
    for event in engine.generate(_request(args, messages, prompt_ids)):
        if isinstance(event, DoneEvent):
            done = event
        elif not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    assert done is not None
    if args.json:
        print(json.dumps({
            "text": done.text, "token_ids": done.token_ids,
            "prompt_tokens": done.prompt_tokens, "cached_tokens": done.cached_tokens,
            "ttft_s": round(done.ttft_s, 4), "prefill_tps": round(done.prefill_tps, 2),
            "decode_tps": round(done.decode_tps, 2),
            "generated_tokens": done.generated_tokens, "finish_reason": done.finish_reason,
            "drafter": done.drafter, "drafted_tokens": done.drafted_tokens,
            "accepted_tokens": done.accepted_tokens,
            "acceptance_by_position": [round(a, 3) for a in done.acceptance_by_position],
        }))
    else:
        print()
        drafting = (f"; {done.drafter} drafted {done.drafted_tokens}, accepted "
                    f"{done.accepted_tokens}" if done.drafter else "; no drafting")
        print(f"[{done.generated_tokens} tokens, {done.decode_tps:.1f} tok/s{drafting}]",
              file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    """Terminal chat: keeps the conversation; /reset clears it, /quit or EOF leaves."""
    from backend.api import DoneEvent
    from backend.errors import ArborError

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    engine = _engine(args, cache=_cache_config(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    stdout.write(f"arbor chat · {engine.info.name} · /reset clears, /quit leaves, "
                 "Ctrl-C stops a reply\n")
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/quit", "/exit"):
            stdout.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": text})
        cancel = threading.Event()
        reply, done = [], None
        try:
            for event in engine.generate(_request(args, system + history), cancel):
                if isinstance(event, DoneEvent):
                    done = event
                else:
                    reply.append(event.text)
                    stdout.write(event.text)
                    stdout.flush()
        except KeyboardInterrupt:
            cancel.set()
        except ArborError as exc:
            history.pop()
            stdout.write(f"\narbor: error: {exc}\n")
            continue
        history.append({"role": "assistant", "content": "".join(reply)})
        if done is not None:
            stdout.write(f"\n  [{done.generated_tokens} tokens, {done.decode_tps:.1f} tok/s, "
                         f"{done.cached_tokens}/{done.prompt_tokens} prompt tokens cached]\n")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM; the model loads (and always runs) on the engine thread.

    MLX, once used from a thread other than the main one, can abort in its static destructors
    at interpreter exit. So once the engine thread has started, this command reports its own
    outcome and leaves without that teardown (everything is written and closed by then)."""
    from backend.errors import ArborError
    from backend.server import serve

    cache = _cache_config(args)
    engine_started = threading.Event()

    def load():
        engine_started.set()
        from backend.batch_default import default_max_batch

        engine = _engine(args, cache=cache, max_batch=args.max_batch or default_max_batch())
        engine.prepare()  # before the first request, not in it
        return engine

    code = 1  # a bug: its traceback is printed
    try:
        code = serve(load, args.host, args.port, args.api_key,
                     announce=lambda line: print(line, flush=True))
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        code = 130
    except Exception as exc:
        if not engine_started.is_set():
            raise  # nothing ran on another thread: main() reports it as usual
        if isinstance(exc, ArborError):
            print(f"arbor: error: {exc}", file=sys.stderr)
            code = EXIT_USAGE
        else:
            traceback.print_exc()
    finally:
        if engine_started.is_set():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def cmd_models(args: argparse.Namespace) -> int:
    from backend.weights.store import ModelStore

    store = ModelStore()
    if args.models_command == "list":
        from backend.speculation.kinds import available_drafters

        models = store.list()
        kinds = {m.name: m.architecture for m in models}
        for m in models:
            # A Gemma 4 assistant is paired like a draft model; the line says which it is.
            kind = {None: " (missing)", "gemma4_assistant": " (assistant)"}.get(
                kinds.get(m.draft), "")
            draft = "" if m.draft is None else f"  draft {m.draft}{kind}"
            drafters = ",".join(available_drafters(m.path, m.draft, kinds.get(m.draft)))
            print(f"{m.name:40} {m.architecture:12} {m.quantization or 'float':12} "
                  f"{m.size_bytes / 1e6:9.1f} MB  drafters {drafters:17}{draft}".rstrip())
            if args.verbose:
                print(f"    {_state_per_token(m.path)}")
    elif args.models_command == "import":
        # A progress line only on a terminal, ended before any error: piped stderr gets
        # nothing but the one-line error.
        on_terminal = sys.stderr.isatty()

        def progress(fraction: float, message: str) -> None:
            if on_terminal:
                sys.stderr.write(f"\r{100 * fraction:5.1f}% {message[:60]:60}")

        try:
            stored = store.import_path(args.path, name=args.name, quantize=args.quantize,
                                       progress=progress, draft=args.draft,
                                       quantize_draft=args.quantize_draft)
        finally:
            if on_terminal:
                sys.stderr.write("\n")
        paired = f" (draft: {stored.draft})" if stored.draft else ""
        print(f"imported {stored.name} -> {stored.path}{paired}")
    elif args.models_command == "rm":
        store.remove(args.name)
        print(f"removed {args.name}")
    elif args.models_command == "unpair":
        store.unpair(args.name)
        print(f"{args.name} has no paired draft now")
    return 0


def _exact_prefill_flags(args: argparse.Namespace) -> list[str]:
    """The server flag for an explicit --exact-prefill / --no-exact-prefill (none: its default)."""
    if args.exact_prefill is None:
        return []
    return ["--exact-prefill" if args.exact_prefill else "--no-exact-prefill"]


def _bench_batch(args: argparse.Namespace, source: Path, work: Path) -> int:
    from backend.bench import batch as bench_batch, speed as bench

    formats = [f for f in args.batch_formats.split(",") if f]
    variants = {f: bench.write_variant(source, work / f"{source.name}-{f}", f) for f in formats}
    clients = tuple(int(n) for n in args.clients.split(",") if n)
    rows, stalls, costs = bench_batch.run(
        variants, work, clients, new_tokens=args.new_tokens or 64,
        against_mlx_lm=args.against == "mlx-lm", log=lambda m: print(m, file=sys.stderr),
        arbor_args=_exact_prefill_flags(args))
    print(bench_batch.format_table(rows, stalls, costs))
    return 0


def _state_per_token(folder: Path) -> str:
    """One line: the cache bytes a token of a conversation takes (float32, the CPU's compute
    dtype), which is what each tier of the prefix cache stores per token."""
    from backend.errors import ArborError
    from backend.models.state_size import state_bytes_per_token
    from backend.weights.files import read_config

    try:
        per_token = state_bytes_per_token(read_config(folder), source=folder / "config.json")
    except ArborError as exc:
        return f"cache per token: unknown ({exc})"
    return f"cache per token: {per_token:,} bytes (float32; {per_token / 1024:.1f} KiB)"


BENCH_SUITES = ("speed", "cache", "spec", "batch", "gguf")


def cmd_bench(args: argparse.Namespace) -> int:
    from backend.bench import speed as bench
    from backend.paths import cache_dir
    from backend.weights.store import ModelStore

    if args.against == "mlx-lm":
        bench.require_mlx_lm()  # before any work: one line saying how to get it
    work = cache_dir() / "bench"
    print(_kernel_state())  # every figure below depends on it: say it with them
    if args.suite == "gguf":
        return _bench_gguf(args, work)
    source = ModelStore().resolve(args.model)
    if args.suite == "cache":
        return _bench_cache(args, Path(source), work)
    if args.suite == "batch":
        return _bench_batch(args, Path(source), work)
    if args.suite == "spec":
        from backend.bench import spec as bench_spec

        # Both sizes read before any work: a typo costs one line, not a whole run.
        assistant_size = _size_option("--assistant-size", args.assistant_size)
        drafter_size = _size_option("--drafter-size", args.drafter_size)
        new_tokens = args.new_tokens or 128
        rows = bench_spec.run(Path(source), work, new_tokens,
                              against_mlx_lm=args.against == "mlx-lm",
                              log=lambda m: print(m, file=sys.stderr))
        print(bench_spec.format_table(rows, new_tokens))
        if assistant_size:
            from backend.bench import assistant as bench_assistant

            costs, same = bench_assistant.run(work, work / f"{Path(source).name}-float32",
                                              *assistant_size,
                                              log=lambda m: print(m, file=sys.stderr))
            print(bench_assistant.format_rows(costs, same))
        if drafter_size:
            from backend.bench import drafters as bench_drafters

            hidden, layers = drafter_size
            costs, same = bench_drafters.run(Path(source), work, hidden, layers,
                                             log=lambda m: print(m, file=sys.stderr))
            print(bench_drafters.format_table(costs, same, hidden, layers))
        return 0
    args.new_tokens = args.new_tokens or 128
    hybrid = []
    if args.hybrid:
        from backend.bench import hybrid as bench_hybrid

        hybrid = _hybrid_families(args.hybrid, bench_hybrid.FAMILIES)  # refused before any run
    formats = tuple(f for f in args.formats.split(",") if f)
    unknown = [f for f in formats if f not in bench.FORMATS]
    if unknown:
        from backend.errors import InvalidRequestError
        raise InvalidRequestError(f"unknown formats {unknown} (choose from {bench.FORMATS})")
    rows = bench.run(Path(source), work, formats, args.prompt_tokens, args.new_tokens,
                     against_mlx_lm=args.against == "mlx-lm",
                     log=lambda m: print(m, file=sys.stderr))
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")
    print(bench.format_table(rows, bench.memory_bandwidth_gbs()))
    print(f"[{formats[0]}] exact prefill by prompt length ...", file=sys.stderr)
    costs = bench.exact_prefill_costs(work / f"{Path(source).name}-{formats[0]}")
    print(bench.format_exact_costs(costs))
    for family in hybrid:
        rows = bench_hybrid.run_hybrid_bench(family=family)
        print(bench_hybrid.describe(family))
        print(bench_hybrid.format_table(rows))
    if args.glm:
        from backend.bench import glm as bench_glm, hybrid as bench_hybrid
        rows = bench_glm.run_glm_bench(log=lambda m: print(m, file=sys.stderr))
        print(bench_glm.describe())
        print(bench_hybrid.format_table(rows))
    return 0


def _kernel_state() -> str:
    """One line: the native CPU kernels' instruction set, or why they are off (then every
    product runs on MLX's own ops, and the figures are not Arbor's usual path)."""
    from backend import kernels

    if kernels.ensure_built():
        return f"native CPU kernels: {kernels.isa()}"
    return f"native CPU kernels: OFF ({kernels.unavailable_reason()})"


def _size_option(flag: str, value: str) -> tuple[int, int] | None:
    """A HIDDENxLAYERS option's two numbers, None for "0" (leave that part out)."""
    from backend.errors import InvalidRequestError

    if value == "0":
        return None
    try:
        hidden, layers = (int(v) for v in value.lower().split("x"))
    except ValueError:
        raise InvalidRequestError(f"{flag} {value!r} is not HIDDENxLAYERS, e.g. 1024x8") from None
    if hidden < 1 or layers < 1:
        raise InvalidRequestError(f"{flag} {value!r}: both numbers must be at least 1")
    return hidden, layers


def _bench_gguf(args: argparse.Namespace, work: Path) -> int:
    from backend.bench import gguf as bench_gguf
    from backend.errors import InvalidRequestError

    path = Path(args.model or "")
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise InvalidRequestError(f"bench gguf needs --model FILE.gguf, got {args.model!r}")
    new_tokens = args.new_tokens or 128
    rows = bench_gguf.run(path, work, new_tokens, against_mlx_lm=args.against == "mlx-lm",
                          log=lambda m: print(m, file=sys.stderr))
    print(bench_gguf.format_table(rows, path.stat().st_size, new_tokens))
    return 0


def _hybrid_families(value: str, known: Iterable[str]) -> list[str]:
    """``--hybrid``'s families (comma-separated, or ``all``); unknown names are refused."""
    families = list(known) if value == "all" else [f for f in value.split(",") if f]
    unknown = [f for f in families if f not in known]
    if unknown or not families:
        from backend.errors import InvalidRequestError
        raise InvalidRequestError(f"unknown hybrid families {unknown or [value]} (choose from "
                                  f"{', '.join(known)}, or all)")
    return families


def _bench_cache(args: argparse.Namespace, source: Path, work: Path) -> int:
    from backend.bench import cache as bench_cache, speed as bench

    folder = bench.write_variant(source, work / f"{source.name}-float32", "float32")
    flags, label = [], []
    for tier in ("device", "host", "disk"):
        value = getattr(args, f"cache_{tier}_mb")
        if value is not None:
            flags += [f"--cache-{tier}-mb", str(value)]
            label.append(f"{tier} {value} MiB")
    if args.no_disk_cache:
        flags.append("--no-disk-cache")
        label.append("no disk")
    if args.exact_prefill is not None:
        flags += _exact_prefill_flags(args)
        label.append("exact prefill" if args.exact_prefill else "plain prefill")
    runs = [(", ".join(label) or "default budgets", flags)]
    if args.with_defaults and flags:
        runs.append(("default budgets", []))
    sizes = tuple(int(n) for n in args.mlx_lm_cache_sizes.split(",") if n) \
        if args.against == "mlx-lm" else ()
    summaries, table = bench_cache.run(
        folder, work, args.conversations, args.turns, args.new_tokens or 48, args.system_tokens,
        runs, sizes, log=lambda m: print(m, file=sys.stderr))
    print(table)
    return 0


def has_display() -> bool:
    if sys.platform in ("darwin", "win32"):
        return True
    if os.environ.get("QT_QPA_PLATFORM", "") in ("offscreen", "minimal"):
        return False
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def cmd_app(args: argparse.Namespace) -> int:
    if getattr(args, "smoke", False):  # a bare `arbor` has no app flags
        from desktop.smoke import run_smoke

        return run_smoke(args.model)
    if not has_display():
        print("arbor: no display found; starting the terminal chat", file=sys.stderr)
        ns = build_parser().parse_args(["chat"] + (["--model", args.model] if args.model else []))
        return cmd_chat(ns)
    from desktop.app import run

    return run(args.model)


COMMANDS = {"app": cmd_app, "chat": cmd_chat, "generate": cmd_generate, "models": cmd_models,
            "bench": cmd_bench, "serve": cmd_serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command or "app"
    if args.command is None:
        args.model, args.dtype = None, None
    import backend  # noqa: F401  (loads the system BLAS before anything imports mlx.core)
    from backend.errors import ArborError

    try:
        return COMMANDS[command](args)
    except ArborError as exc:
        print(f"arbor: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
