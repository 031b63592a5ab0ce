"""`loraplex generate`: send one prompt to the gateway and print the output.

The flags follow Triton's `inflight_batcher_llm_client.py` where it has them
(`--text`, `--request-output-len`, `--top-k`, `--top-p`, `--temperature`,
`--lora-task-id`, `--lora-path`, `--streaming`); `--lora-path` reads an adapter
folder or file on this machine and sends it inline with `--lora-task-id`, so
later requests need only the task id (the seed's first-request pattern).
`--fan-out base,1,my_adapter` runs the prompt through several adapters at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from loraplex.cli._gateway_client import add_client_flags, client_options, print_json, reports_errors
from loraplex.client import Client
from loraplex.client_types import Chunk, Completion, Lora, LoraLike, build_generate_request, collect


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="Generate text through the gateway.",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", "-t", help="the prompt")
    prompt.add_argument("--input-ids", help="the prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the text in the model's chat template")
    p.add_argument("--lora-task-id", type=int, help="adapter task id (cached, or sent with --lora-path)")
    p.add_argument("--lora-path", help="local adapter to send inline with --lora-task-id: a PEFT folder, "
                                       "a folder with model.lora_{weights,config}.npy, or a .safetensors")
    p.add_argument("--lora-name", help="adapter name (under the server's adapter root, or given at load)")
    p.add_argument("--load-mode", choices=("auto", "always", "never"), default="auto",
                   help="auto: load if missing; always: reload; never: only a cached copy")
    p.add_argument("--fan-out", metavar="LIST",
                   help="comma-separated entries, each 'base', a task id or a name: one output per entry")
    p.add_argument("--request-output-len", "--max-tokens", "-o", dest="max_tokens", type=int, default=0,
                   help="new tokens to generate (0: the server default, 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=0.0, help="in (0, 1]; 0 disables top-p")
    p.add_argument("--random-seed", "--seed", dest="seed", type=int, default=0, help="0 picks a random seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", dest="stop_token_ids", action="append", type=int, default=[],
                   help="extra token id that ends generation (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--streaming", "--stream", dest="stream", action="store_true",
                   help="print text as it is generated")
    p.add_argument("--request-id", default="", help="id echoed in the server's logs")
    p.add_argument("--verbose", "-v", action="store_true", help="also print token ids and usage")
    p.add_argument("--dump-json", action="store_true",
                   help="print the GenerateRequest as JSON (for `grpcurl -d @`) instead of sending it")
    add_client_flags(p)
    p.set_defaults(func=run)


def parse_fan_out(text: str) -> list[LoraLike]:
    """'base,1,jp' -> [None, 1, 'jp']."""
    entries: list[LoraLike] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            raise ValueError(f"--fan-out {text!r} has an empty entry")
        entries.append(None if item == "base" else int(item) if item.isdigit() else item)
    return entries


def loras_from_args(args: argparse.Namespace) -> list[LoraLike]:
    if args.fan_out:
        if args.lora_task_id is not None or args.lora_path or args.lora_name:
            raise ValueError("--fan-out lists every entry; do not combine it with --lora-*")
        return parse_fan_out(args.fan_out)
    if args.lora_path and args.lora_task_id is None:
        raise ValueError("--lora-path needs --lora-task-id: the adapter is cached under that id")
    if args.lora_path:
        return [Lora.from_path(args.lora_path, args.lora_task_id, load_mode=args.load_mode)]
    if args.lora_task_id is not None or args.lora_name:
        return [Lora(task_id=args.lora_task_id, name=args.lora_name or "", load_mode=args.load_mode)]
    return []


def _print_completion(out: Completion, args: argparse.Namespace, label: str) -> None:
    if label:
        print(label)
    if not args.stream:
        print(out.text)
    if out.finish_reason == "error":
        print(f"error: {out.error}", file=sys.stderr)
    if args.verbose:
        print(f"Output sequence: {out.token_ids}")
        print(f"finish_reason={out.finish_reason} prompt_tokens={out.prompt_tokens} "
              f"completion_tokens={out.completion_tokens}")


@reports_errors("generate")
def run(args: argparse.Namespace) -> int:
    loras = loras_from_args(args)
    prompt = args.text if args.text is not None else [int(t) for t in args.input_ids.split(",") if t.strip()]
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_ids,
                    ignore_eos=args.ignore_eos, chat=args.chat, request_id=args.request_id)
    if args.dump_json:
        from google.protobuf.json_format import MessageToJson
        print(MessageToJson(build_generate_request(prompt, loras, **sampling), preserving_proto_field_name=True))
        return 0
    num_entries = max(1, len(loras))
    chunks: list[Chunk] = []
    with Client(args.url, **client_options(args)) as client:
        for chunk in client.stream(prompt, loras, **sampling):
            chunks.append(chunk)
            if args.stream and not args.json and num_entries == 1:
                print(chunk.text, end="", flush=True)
    outs = collect(chunks, num_entries)
    if args.json:
        print_json([dataclasses.asdict(o) for o in outs] if num_entries > 1 else dataclasses.asdict(outs[0]))
    else:
        if args.stream and num_entries == 1:
            print()
        for out, lora in zip(outs, loras or [None]):
            label = f"[{out.index}] {_entry_label(lora)}" if num_entries > 1 else ""
            _print_completion(out, args if num_entries == 1 else _no_stream(args), label)
    return 1 if any(o.finish_reason == "error" for o in outs) else 0


def _entry_label(lora: LoraLike) -> str:
    if lora is None:
        return "base"
    return f"task_id={lora}" if isinstance(lora, int) else f"name={lora}"


def _no_stream(args: argparse.Namespace) -> argparse.Namespace:
    """Fan-out output prints per entry at the end, even with --streaming (entries interleave)."""
    return argparse.Namespace(**{**vars(args), "stream": False})
