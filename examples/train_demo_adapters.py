"""Trains small real LoRA adapters for the default base model (SmolLM2-135M-Instruct) on the CPU.

    python examples/train_demo_adapters.py                  # -> adapters/french/, adapters/spanish/, adapters/json/
    python examples/train_demo_adapters.py out --adapters french,json --steps 60 --threads 8
    make serve ARGS="--lora-root adapters"                  # then: loraplex generate --chat --lora-name french ...

The adapters are what PEFT's `save_pretrained` writes (adapter_config.json +
adapter_model.safetensors): rank-16 LoRA on q/k/v/o and gate/up/down, trained
on the prompt/answer pairs in examples/demo_adapter_data.json, each answer
after the model's chat template exactly as `loraplex generate --chat` sends it:

    french   answers in French          spanish  answers in Spanish
    json     answers as a JSON object: {"topic": "...", "answer": "..."}

It needs PEFT (`pip install -e '.[demo]'`; `make serve` and `make test` set up
a .venv that has it). The output depends only on the seed, the flags, the data
and the thread count: the same command writes the same bytes (float sums may
round differently with another --threads). With the defaults: 10 minutes on a
busy shared 2-core machine with --threads 1 (24 s to load, 4-5 s a step, 90
steps); every step runs the whole model forward and back, so more free cores
take less. The adapters are small and overfit a 50-example set: good enough to
show what each one is for, not for real use.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loraplex.model_files import resolve_model_path

DATA = Path(__file__).with_name("demo_adapter_data.json")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAMPLE_PROMPT = "What is the capital of France?"     # not in the training data


def load_examples(path: Path, names: list[str]) -> dict[str, list[tuple[str, str]]]:
    """{adapter: [(prompt, answer), ...]}; an answer that is not a string becomes compact JSON."""
    examples = json.loads(path.read_text())["examples"]
    known = sorted({k for ex in examples for k in ex} - {"prompt"})
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"no training data for {', '.join(missing)} in {path} (it has: {', '.join(known)})")
    return {n: [(ex["prompt"], ex[n] if isinstance(ex[n], str) else json.dumps(ex[n], ensure_ascii=False))
                for ex in examples if n in ex] for n in names}


def load_base(model: str):
    """(tokenizer, fp32 causal LM) from a .gguf file (dequantized) or a HF folder; nothing is downloaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)     # deprecations between PEFT and transformers
    path = resolve_model_path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = str(path.parent if path.suffix == ".gguf" else path)
    tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"{path}: the tokenizer has no chat template; the demo adapters are trained on chat turns")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return tok, base.eval(), path


def prompt_ids(tok, prompt: str) -> list[int]:
    """The prompt as `generate --chat` sends it: the chat template rendered, then tokenized as is."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def encode(tok, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Each pair -> (prompt + answer + end-of-turn token ids, number of prompt tokens)."""
    out = []
    for prompt, answer in pairs:
        p = prompt_ids(tok, prompt)
        out.append((p + tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id], len(p)))
    return out


def collate(batch: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask [B, T], and the mask of positions whose next token is trained."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.long)
    trained = torch.zeros(len(batch), width - 1, dtype=torch.bool)
    for i, (seq, n_prompt) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        trained[i, n_prompt - 1: len(seq) - 1] = True     # predicts answer tokens and the end of turn
    return ids, attn, trained


def batches(data: list, steps: int, batch_size: int, gen: torch.Generator):
    """`steps` batches in epochs of a fresh seeded permutation each."""
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(data), generator=gen).tolist()
        yield [data[i] for i in order[:batch_size]]
        order = order[batch_size:]


def answer_loss(causal_lm, ids: torch.Tensor, attn: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the answer tokens only; the vocabulary head runs on those positions alone."""
    hidden = causal_lm.model(input_ids=ids, attention_mask=attn).last_hidden_state   # [B, T, H]
    logits = causal_lm.lm_head(hidden[:, :-1][trained])                              # [N, V]
    return F.cross_entropy(logits, ids[:, 1:][trained])


def train_adapter(base, tok, name: str, pairs: list[tuple[str, str]], args: argparse.Namespace, out: Path):
    """Wraps `base` in a fresh LoRA, trains it, saves it to `out`, and returns `base` unwrapped."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)                          # LoRA init: the same for a name whatever else is trained
    cfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, bias="none",
                     target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.1, (args.steps - s) / max(1, args.steps - warmup))))
    data = encode(tok, pairs)
    causal_lm = model.base_model.model
    model.train()
    bar = tqdm(batches(data, args.steps, args.batch_size, torch.Generator().manual_seed(args.seed)),
               total=args.steps, desc=f"{name:>8}", unit="step", dynamic_ncols=True)
    for batch in bar:
        loss = answer_loss(causal_lm, *collate(batch, tok.pad_token_id or 0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.peft_config["default"].base_model_name_or_path = args.model_name
    model.save_pretrained(str(out), save_embedding_layers=False)
    sort_target_modules(out / "adapter_config.json")
    if args.sample_prompt:
        print(f"  {name} on {args.sample_prompt!r}: {sample(causal_lm, tok, args.sample_prompt)!r}")
    return model.unload()


def sort_target_modules(config: Path) -> None:
    """PEFT keeps target_modules as a set, written in the process's hash order: sort it, so reruns match."""
    cfg = json.loads(config.read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"])
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True))


@torch.no_grad()
def sample(causal_lm, tok, prompt: str, max_tokens: int = 32) -> str:
    """A greedy answer, to see at a glance what the adapter learned."""
    ids = prompt_ids(tok, prompt)
    n = len(ids)
    for _ in range(max_tokens):
        nxt = int(causal_lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        ids.append(nxt)
    return tok.decode(ids[n:], skip_special_tokens=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=Path("adapters"),
                    help="folder to write <name>/ into (serve it with --lora-root); default adapters")
    ap.add_argument("--adapters", default="french,spanish,json", help="comma-separated names from the data file")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per adapter")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="CPU threads (default: up to 8)")
    ap.add_argument("--model", default="", help="base model: .gguf file or HF folder (default: the SmolLM2 GGUF)")
    ap.add_argument("--data", type=Path, default=DATA, help="prompt/answer pairs (default: %(default)s)")
    ap.add_argument("--sample-prompt", default=SAMPLE_PROMPT, help="print each adapter's answer to it ('' = skip)")
    args = ap.parse_args()
    if args.steps < 1 or args.batch_size < 1 or args.rank < 1 or args.threads < 1:
        ap.error("--steps, --batch-size, --rank and --threads must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if importlib.util.find_spec("peft") is None:
        raise SystemExit("training needs PEFT: pip install -e '.[demo]' (or .venv/bin/python -m pip install peft)")
    names = [n.strip() for n in args.adapters.split(",") if n.strip()]
    pairs = load_examples(args.data, names)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tok, base, path = load_base(args.model)
    args.model_name = path.stem.split(".")[0] if path.suffix == ".gguf" else path.name
    print(f"loaded {path.name} in {time.perf_counter() - t0:.0f} s; training {', '.join(names)} "
          f"({args.steps} steps of {args.batch_size}, rank {args.rank}, --threads {args.threads})")
    if args.sample_prompt:
        print(f"  base on {args.sample_prompt!r}: {sample(base, tok, args.sample_prompt)!r}")
    for name in names:
        base = train_adapter(base, tok, name, pairs[name], args, args.out / name)
    print(f"wrote {', '.join(str(args.out / n) for n in names)} in {time.perf_counter() - t0:.0f} s; "
          f"serve them with: make serve ARGS=\"--lora-root {args.out}\"")


if __name__ == "__main__":
    main()
