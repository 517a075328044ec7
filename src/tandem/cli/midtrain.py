"""`tandem midtrain`: build tandem's base model (tokenizer, corpus, Qwen3 model) and mid-train it.

The corpus is assembled here because it needs ``tandem.env`` (expert transcripts), which ``tandem.train``
may not import: Python standard-library source files of this interpreter (sorted by name, whole files, up to
``code_mb``) plus ``transcripts`` scripted-expert sessions on TRAIN-split built-in tasks, rendered with the
exact chat-format pieces RL uses (``ChatTemplate.render_transcript``).

Invariants: everything is a pure function of the preset and options (same machine, same threads), so the
recipe reproduces the model; the output directory is a complete HF model dir (config.json,
model.safetensors, tokenizer files, generation_config.json) plus ``recipe.json`` and ``metrics.jsonl``;
``--resume`` reuses the tokenizer saved in the output dir and continues from its checkpoint. Bad options
(unknown preset, --steps/--stop-after < 1, --threads outside 1..``MAX_THREADS``, an --out that is not empty,
not a writable ordinary directory, or has no usable checkpoint to resume) print one ``error:`` line and exit
with status 2 before anything is built or written; a checkpoint that ``--resume`` finds damaged or not this
model's is refused the same way, before anything in ``--out`` changes. A write that fails (a full disk) is
one ``error:`` line, exit status 1, naming what is kept (checkpoints are replaced atomically). A stop signal
during the final save waits for it: a finished run's model is whole once the command ends.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import signal
import sys
import time
import zipfile
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.cli.checks import threads_problem, writable_dir_problem
from tandem.core import stopping
from tandem.core.errors import TandemError
from tandem.core.stopping import StopRequested, stop_on_signals
from tandem.train.midtrain import CHECKPOINT, CheckpointWriteError, MidtrainSettings, midtrain, pack


@dataclasses.dataclass
class Preset:
    """A full recipe: model size, tokenizer, corpus and optimisation settings."""

    model_size: str
    vocab_size: int
    code_mb: float
    transcripts: int
    levels: tuple[int, ...]
    tokenizer_transcripts: int
    corpus_seed: int
    model_seed: int
    settings: MidtrainSettings


PRESETS: dict[str, Preset] = {
    "default": Preset(
        model_size="default",
        vocab_size=4096,
        code_mb=0.25,
        transcripts=6000,
        levels=(1, 2, 3),
        tokenizer_transcripts=1000,
        corpus_seed=0,
        model_seed=0,
        settings=MidtrainSettings(
            steps=700, seq_len=1024, batch_size=4, lr=3e-3, warmup_steps=30, checkpoint_every=25
        ),
    ),
    "smoke": Preset(
        model_size="smoke",
        vocab_size=384,
        code_mb=0.03,
        transcripts=12,
        levels=(1, 2, 3),
        tokenizer_transcripts=12,
        corpus_seed=0,
        model_seed=0,
        settings=MidtrainSettings(
            steps=6, seq_len=128, batch_size=2, lr=3e-3, warmup_steps=2, checkpoint_every=3
        ),
    ),
}


def stdlib_sources(max_bytes: int) -> list[tuple[str, str]]:
    """``(name, text)`` of this interpreter's top-level stdlib ``*.py`` files, sorted, whole files, capped."""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    out: list[tuple[str, str]] = []
    total = 0
    for f in sorted(lib.glob("*.py")):
        if total >= max_bytes:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append((f.name, text))
        total += len(text.encode())
    if not out:
        raise FileNotFoundError(f"no Python standard-library sources found under {lib}")
    return out


def build_corpus(p: Preset, out: Path, resume: bool) -> tuple[Any, list[list[int]], dict[str, Any]]:
    """Train (or, on resume, reload) the tokenizer into ``out``; return (chat format, docs, corpus stats)."""
    from tandem.env.expert import expert_corpus
    from tandem.env.tasks import TOOLS
    from tandem.model.chat import ChatTemplate, render_text
    from tandem.model.load import load_tokenizer
    from tandem.model.tokenizer import check_tokenizer, save_tokenizer, train_tokenizer

    code = stdlib_sources(int(p.code_mb * 2**20))
    transcripts = list(expert_corpus(p.transcripts, seed=p.corpus_seed, levels=list(p.levels)))
    if resume and (out / "tokenizer.json").is_file():
        tok = load_tokenizer(out)
    else:
        sample = [t for _, t in code] + [
            render_text(m, TOOLS, False) for m in transcripts[: p.tokenizer_transcripts]
        ]
        raw = train_tokenizer(sample, vocab_size=p.vocab_size)
        check_tokenizer(raw)
        save_tokenizer(raw, out, model_max_length=p.settings.seq_len)
        tok = load_tokenizer(out)
    chat = ChatTemplate(tok)
    code_docs = [chat.encode_text(t) for _, t in code]
    tr_docs = [chat.render_transcript(m, TOOLS) for m in transcripts]
    stats = {
        "code_files": len(code),
        "code_bytes": sum(len(t.encode()) for _, t in code),
        "code_tokens": sum(map(len, code_docs)),
        "code_first_last": [code[0][0], code[-1][0]],
        "transcripts": len(tr_docs),
        "transcript_tokens": sum(map(len, tr_docs)),
        "transcript_max_tokens": max(map(len, tr_docs)),
        "vocab_size": len(tok),
    }
    return chat, code_docs + tr_docs, stats


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def run_midtrain(
    preset: str,
    out: Path,
    resume: bool = False,
    steps: int | None = None,
    threads: int = 2,
    stop_after: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Do the whole recipe; returns the recipe dict (also written to ``out/recipe.json`` when finished)."""
    import torch
    from transformers import GenerationConfig

    from tandem.model.build import build_model, num_params, qwen3_config

    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}")
    p = dataclasses.replace(PRESETS[preset])
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, got {steps}")
        p.settings = dataclasses.replace(p.settings, steps=steps)
    torch.set_num_threads(threads)
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    chat, docs, stats = build_corpus(p, out, resume)
    rows = pack(docs, chat.eos_token_id, p.settings.seq_len, p.corpus_seed)
    config = qwen3_config(p.model_size, vocab_size=stats["vocab_size"], eos_token_id=chat.eos_token_id)
    config.max_position_embeddings = max(config.max_position_embeddings, p.settings.seq_len)
    model = build_model(config, seed=p.model_seed)
    if progress:
        print(
            f"midtrain: {num_params(model):,} params, {len(rows)} rows of {p.settings.seq_len} tokens, "
            f"corpus {json.dumps(stats)} (prepared in {time.monotonic() - t0:.1f}s)",
            file=sys.stderr,
        )
    summary = midtrain(model, rows, p.settings, out, resume=resume, stop_after=stop_after, progress=progress)
    # Writing the model takes a moment after the last step: a stop signal then waits for it (before, it
    # said "nothing was trained: remove OUT" of a finished run, and could leave a half-written model).
    with stopping.deferred():
        recipe: dict[str, Any] = {
            "command": f"tandem midtrain --preset {preset} --out {out}"
            + (f" --steps {steps}" if steps is not None else "")
            + f" --threads {threads}",
            "preset": preset,
            "model_size": p.model_size,
            "model_config": config.to_diff_dict(),
            "params": num_params(model),
            "tokenizer": {
                "vocab_size": p.vocab_size,
                "type": "byte-level BPE",
                "trained_on_transcripts": p.tokenizer_transcripts,
            },
            "corpus": {
                **stats,
                "levels": list(p.levels),
                "seed": p.corpus_seed,
                "rows": len(rows),
                "source": "stdlib *.py (sorted) + tandem.env.expert.expert_corpus (train split)",
                "loss_mask": "all tokens",
            },
            "model_seed": p.model_seed,
            "settings": p.settings.to_dict(),
            "threads": threads,
            **summary,
            "versions": _versions(),
        }
        lines = (out / "metrics.jsonl").read_text().splitlines()
        tail = [json.loads(x)["loss"] for x in lines[-10:]]
        recipe["mean_loss_last10"] = sum(tail) / max(1, len(tail))
        if not summary["finished"]:
            return recipe
        model.generation_config = GenerationConfig(
            eos_token_id=chat.stop_token_ids,
            pad_token_id=chat.eos_token_id,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=192,
        )
        try:
            model.save_pretrained(str(out), safe_serialization=True)
            recipe["total_wall_s"] = time.monotonic() - t0
            (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
        except Exception as e:  # noqa: BLE001 - a full disk comes as OSError or safetensors' own error
            raise CheckpointWriteError(
                f"could not write the model into {out} ({type(e).__name__}: {e}); training finished and its "
                f"checkpoint {out / CHECKPOINT} is kept: free disk space and run the same command with "
                "--resume"
            ) from e
        shutil.rmtree(out / Path(CHECKPOINT).parent, ignore_errors=True)
        return recipe


def midtrain_command(
    preset: Annotated[
        str, typer.Option(help="Recipe: `default` (the shipped tandem-base) or `smoke`.")
    ] = "default",
    out: Annotated[
        Path | None, typer.Option(help="Output model dir (default: runs/midtrain-PRESET).")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUT/checkpoint.")] = False,
    steps: Annotated[
        int | None, typer.Option(help="Override the preset's number of optimizer steps.")
    ] = None,
    threads: Annotated[int, typer.Option(help="Torch intra-op threads.")] = 2,
    stop_after: Annotated[
        int | None, typer.Option(hidden=True, help="Stop (resumably) after N steps.")
    ] = None,
) -> None:
    """Mid-train a small Qwen3 model on stdlib code + expert agent transcripts into an HF model dir."""
    out_dir = out if out is not None else Path("runs") / f"midtrain-{preset}"
    problem = _check_options(preset, steps, threads, stop_after) or _check_out(out_dir, resume)
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    try:
        with stop_on_signals():
            recipe = run_midtrain(
                preset, out_dir, resume=resume, steps=steps, threads=threads, stop_after=stop_after
            )
    except StopRequested as e:  # before the first step (tokenizer, corpus): nothing to save yet
        typer.echo(
            f"stopped by {signal.Signals(e.signum).name} before training started; "
            + (
                "the same command resumes again"
                if resume
                else f"nothing was trained: remove {out_dir} (or pass another --out) and start again"
            ),
            err=True,
        )
        raise typer.Exit(128 + e.signum) from None
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except (TandemError, OSError) as e:  # a full disk while training or saving: say what is kept
        message = str(e)
        if not isinstance(e, TandemError):
            what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
            kept = (
                f"continue from its last checkpoint with --resume --out {out_dir}"
                if (out_dir / CHECKPOINT).is_file()
                else "start again"
            )
            message = f"writing {out_dir} failed ({what}); free disk space (or fix the cause) and {kept}"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1) from None
    if recipe["finished"]:
        typer.echo(
            f"wrote {out_dir} ({recipe['params']:,} params, final loss {recipe['final_loss']:.4f}, "
            f"{recipe['total_wall_s']:.0f}s)"
        )
        return
    at = f"at step {recipe['steps_done']}; continue with --resume --out {out_dir}"
    if recipe["stopped_by"]:  # Ctrl-C, SIGTERM or SIGHUP, at a step boundary, checkpointed
        typer.echo(f"stopped by {recipe['stopped_by']} (checkpointed) " + at, err=True)
        raise typer.Exit(128 + signal.Signals[recipe["stopped_by"]].value)
    typer.echo("stopped " + at)


def _check_options(preset: str, steps: int | None, threads: int, stop_after: int | None) -> str | None:
    """Why the preset or a number option cannot work (checked before ``--out`` is touched)."""
    if preset not in PRESETS:
        return f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}"
    for flag, value in (("--steps", steps), ("--stop-after", stop_after)):
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    return threads_problem("--threads", threads)


def _check_out(out: Path, resume: bool) -> str | None:
    """Why ``--out``/``--resume`` cannot work, before anything is built or written: a new run never writes
    into a non-empty directory (it replaced the shipped model's files when pointed at it), a resume needs the
    checkpoint a stopped run left (a ``torch.save`` zip archive), and ``--out`` must be an ordinary writable
    directory (``/proc/x`` or a path under a file failed only after the corpus was built)."""
    if out.exists() and not out.is_dir():
        return f"--out {str(out)!r} exists and is not a directory; pass a new or empty directory"
    if resume:
        ckpt = out / CHECKPOINT
        if not ckpt.is_file():
            return f"--resume: no {CHECKPOINT} under {str(out)!r}; start without --resume"
        if not zipfile.is_zipfile(ckpt):
            return (
                f"--resume: {str(ckpt)!r} is not a checkpoint (not a torch.save archive: damaged or cut "
                "off); start again in a new --out without --resume"
            )
    elif out.is_dir() and any(out.iterdir()):
        return (
            f"--out {str(out)!r} is not empty; a new mid-training run would overwrite its files. Pass a new "
            "or empty directory, or --resume to continue a stopped run there"
        )
    return writable_dir_problem("--out", out)


app = typer.Typer(help="Mid-train tandem's base model.")
app.command("midtrain")(midtrain_command)
