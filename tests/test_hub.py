"""`hf-rebasin push` and loading by Hub id, against a fake Hub on 127.0.0.1 (tests/hub_server.py)."""
from __future__ import annotations

import json
import shlex
import shutil
import types
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub, use_fake_hub, write_merge_output
from huggingface_hub import ModelCard

from hf_rebasin.cli import UserError, main
from hf_rebasin.hub import cards
from hf_rebasin.hub.push import publishable_report, push
from hf_rebasin.sources import models
from hf_rebasin.tiny import example_inputs, outputs


@pytest.fixture
def tiny(tiny_dirs):
    return tiny_dirs  # conftest.py: one tiny checkpoint folder per kind, shared by the session


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub(lifetime_s=120) as server:
        use_fake_hub(monkeypatch, server, tmp_path)
        yield server


@pytest.fixture
def merge_dir(tiny, tmp_path):
    out = tmp_path / "merged"
    shutil.copytree(tiny["gpt_neox"], out)
    write_merge_output(out)
    return out


@pytest.fixture
def no_backoff_sleep(monkeypatch):
    """huggingface_hub retries 5xx answers with exponential backoff (1+2+4+8+8 s); record the waits instead."""
    from huggingface_hub.utils import _http
    waits: list[float] = []
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=waits.append))
    return waits


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_uploads_the_folder_byte_for_byte(hub, merge_dir, tiny):
    (merge_dir / ".README.md.4242.0badf00d.tmp").write_text("left by a killed write")
    url = push(merge_dir, "someuser/merged-neox")
    remote = hub.files("someuser/merged-neox")
    local = {k: v for k, v in local_files(merge_dir).items() if not k.endswith(".tmp")}
    assert set(local) == set(local_files(tiny["gpt_neox"])) | {"barrier.json", "barrier.png", "README.md"}
    assert {"model.safetensors", "config.json"} <= set(local)
    assert set(remote) == set(local) | {".gitattributes"}
    for name, content in local.items():
        if name != "barrier.json":  # the folder's card is now the published one
            assert remote[name] == content, name
    # barrier.json is published with local paths by their names: nothing absolute leaves the machine
    assert remote["barrier.json"] == publishable_report(merge_dir).encode()
    published = json.loads(remote["barrier.json"])
    assert published["models"] == ["EleutherAI/pythia-14m", "seed2"] and published["barrier"] > 0
    for name in ("barrier.json", "README.md"):
        assert str(merge_dir.parent).encode() not in remote[name], name
    assert url == f"{hub.endpoint}/someuser/merged-neox/commit/{hub.repos['someuser/merged-neox'].branches['main']}"
    card = ModelCard(remote["README.md"].decode())
    assert card.data.model_name == "merged-neox"
    assert card.data.base_model == ["EleutherAI/pythia-14m"]
    assert card.data.library_name == "transformers"
    assert {"merge", "hf-rebasin", "wm"} <= set(card.data.tags)
    assert card.data.license == "apache-2.0"
    assert hub.count("validate") == 1  # huggingface_hub checked the card's metadata before uploading


def test_push_from_the_command_line(hub, merge_dir, capsys):
    code = main(["push", str(merge_dir), "someuser/cli-neox", "--private", "--commit-message", "first merge"])
    assert code == 0
    repo = hub.repos["someuser/cli-neox"]
    assert capsys.readouterr().out.strip() == f"{hub.endpoint}/someuser/cli-neox/commit/{repo.branches['main']}"
    assert repo.private
    assert hub.files("someuser/cli-neox")["model.safetensors"] == (merge_dir / "model.safetensors").read_bytes()


def test_existing_repo_needs_exist_ok(hub, merge_dir):
    push(merge_dir, "someuser/twice")
    first = hub.repos["someuser/twice"].branches["main"]
    with pytest.raises(UserError, match="someuser/twice already exists; pass --exist-ok"):
        push(merge_dir, "someuser/twice")
    assert hub.repos["someuser/twice"].branches["main"] == first  # nothing was uploaded

    barrier = json.loads((merge_dir / "barrier.json").read_text())
    barrier["notes"].append("re-run with more data")
    (merge_dir / "barrier.json").write_text(json.dumps(barrier))
    push(merge_dir, "someuser/twice", exist_ok=True)
    remote = hub.files("someuser/twice")
    assert hub.repos["someuser/twice"].branches["main"] != first
    assert json.loads(remote["barrier.json"])["notes"] == barrier["notes"]
    assert "* re-run with more data" in remote["README.md"].decode()  # the card was re-rendered before upload


def test_push_to_a_branch(hub, merge_dir):
    push(merge_dir, "someuser/branchy", revision="experiment")
    assert set(hub.files("someuser/branchy", "main")) == {".gitattributes"}
    assert hub.files("someuser/branchy", "experiment")["barrier.png"] == (merge_dir / "barrier.png").read_bytes()


def test_no_token(hub, merge_dir, monkeypatch, tmp_path):
    use_fake_hub(monkeypatch, hub, tmp_path, token=None)
    with pytest.raises(UserError, match=r"set HF_TOKEN .* or run `hf auth login`"):
        push(merge_dir, "someuser/no-token")
    assert hub.repos == {}


def test_rejected_token(hub, merge_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_right_one")
    with pytest.raises(UserError, match=r"refused to create someuser/bad-token \(401\).*HF_TOKEN"):
        push(merge_dir, "someuser/bad-token")
    assert hub.repos == {}


def test_failed_upload_leaves_dir_intact_and_says_how_to_retry(hub, merge_dir, no_backoff_sleep):
    cards.write_card(merge_dir, model_name="flaky")  # the card push publishes, so the snapshot includes it
    before = local_files(merge_dir)
    hub.fail("commit", 500)
    with pytest.raises(UserError) as error:
        push(merge_dir, "someuser/flaky", commit_message="try it")
    message = str(error.value)
    retry = f"hf-rebasin push {merge_dir} someuser/flaky --commit-message 'try it'"
    assert "failed" in message and "500" in message and message.endswith(f"retry with: {retry}")
    assert "someuser/flaky it had created was deleted" in message
    assert no_backoff_sleep, "the client should have retried the 500 before giving up"
    assert local_files(merge_dir) == before
    assert "someuser/flaky" not in hub.repos  # the empty repo it created is gone: the retry needs no --exist-ok

    hub.failures.clear()
    assert main(shlex.split(retry)[1:]) == 0  # the printed command works as given
    remote = hub.files("someuser/flaky")
    assert all(remote[name] == content for name, content in before.items() if name != "barrier.json")
    assert remote["barrier.json"] == publishable_report(merge_dir).encode()


def assert_loads_like_local(hub_id: str, folder: Path, kind: str, home: Path) -> None:
    from_hub = models.load(hub_id)
    local = models.load(folder)
    assert from_hub.source == hub_id and type(from_hub.model) is type(local.model)
    inputs = example_inputs(kind)
    assert torch.equal(outputs(from_hub.model, inputs), outputs(local.model, inputs))
    cached = list((home / "hub" / f"models--{hub_id.replace('/', '--')}").rglob("model.safetensors"))
    assert cached, "the weights should have come through HF_ENDPOINT into the test's cache"


def test_load_a_pushed_model_by_hub_id(hub, merge_dir, tmp_path):
    push(merge_dir, "someuser/tiny-neox")
    hub.requests.clear()
    assert_loads_like_local("someuser/tiny-neox", merge_dir, "gpt_neox", tmp_path / "hf_home")
    assert hub.count("resolve") > 0


def test_load_a_timm_vit_by_hub_id(hub, tiny, tmp_path):
    hub.add_folder("someuser/tiny-vit", tiny["vit"])  # a read-only mirror of the folder
    assert_loads_like_local("someuser/tiny-vit", tiny["vit"], "vit", tmp_path / "hf_home")
    assert hub.count("resolve") > 0


def test_load_from_the_offline_cache(hub, tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants
    hub.add_folder("someuser/cached-neox", tiny["gpt_neox"])
    models.load("someuser/cached-neox")  # fills the cache
    for route in ("resolve", "info", "tree"):
        hub.fail(route, 503)  # nothing may be fetched from now on
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    assert_loads_like_local("someuser/cached-neox", tiny["gpt_neox"], "gpt_neox", tmp_path / "hf_home")
    assert hub.requests == []


def test_unknown_hub_id_is_a_clear_error(hub):
    with pytest.raises(models.ModelLoadError, match="someuser/missing"):
        models.load("someuser/missing")
