"""Issue 48: one rule for every file and folder hf-rebasin writes.  Never inside a source model or the data,
never over a file it did not write (without --force), --force replacing only what it wrote (the output's
manifest), every place proven writable before the work, nothing local pushed."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from hf_rebasin.cli import main
from hf_rebasin.export.ownership import MANIFEST

FAST = ["--lambdas", "3", "--seq-len", "32", "--max-eval-tokens", "256", "--batch-size", "4"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny GPT-NeoX models (only the kind needed: conftest's pair makes every kind)."""
    from hf_rebasin import tiny
    root = tmp_path_factory.mktemp("pair")
    return tiny.make_tiny("gpt_neox", root / "model-a", seed=1), tiny.make_tiny("gpt_neox", root / "model-b", seed=2)


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --self-samples-dir and --checkpoint-dir are relative


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def refused(capsys, *argv, naming: str = "") -> str:
    code, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert naming in lines[0], lines[0]
    return lines[0]


def hashes(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for folder in folders
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def barrier_args(pair, data, *extra):
    return ["barrier", pair[0], pair[1], "--data", data, "--method", "raw", *FAST, *extra]


def merge_args(pair, data, out, *extra):
    return ["merge", pair[0], pair[1], "--data", data, "--method", "raw", *FAST, "--out", out, *extra]


# --- repro 1: barrier --json over any file ----------------------------------------------------------

@pytest.mark.parametrize("target", ["model.safetensors", "config.json"])
def test_barrier_json_never_writes_into_a_source_model(capsys, pair, text_file, target):
    before = hashes(pair[1])
    refused(capsys, *barrier_args(pair, text_file, "--json", pair[1] / target), naming="source model")
    assert hashes(pair[1]) == before


def test_barrier_json_never_writes_over_the_data_or_a_users_file(capsys, pair, text_file, tmp_path):
    data = tmp_path / "heldout.txt"
    shutil.copy(text_file, data)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    refused(capsys, *barrier_args(pair, data, "--json", data), naming="data")
    refused(capsys, *barrier_args(pair, data, "--json", notes), naming="not a file hf-rebasin wrote")
    assert data.read_bytes() == text_file.read_bytes() and notes.read_text() == '{"mine": true}\n'
    report = tmp_path / "report.json"
    assert run(capsys, *barrier_args(pair, data, "--json", report))[0] == 0
    first = json.loads(report.read_text())
    assert run(capsys, *barrier_args(pair, data, "--json", report))[0] == 0  # its own report is replaced
    assert json.loads(report.read_text())["barrier"] == first["barrier"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.txt", "notes.json", "report.json"]


# --- repro 2: merge --force over a folder with a barrier.json -----------------------------------------

def test_force_never_removes_a_users_files_beside_a_report(capsys, pair, text_file, tmp_path):
    project = tmp_path / "proj"
    (project / "code").mkdir(parents=True)
    (project / "thesis.tex").write_text("draft")
    (project / "code" / "run.py").write_text("print(1)")
    assert run(capsys, *barrier_args(pair, text_file, "--json", project / "barrier.json"))[0] == 0
    line = refused(capsys, *merge_args(pair, text_file, project, "--force"), naming="did not write")
    assert "thesis.tex" in line and "code/run.py" in line
    assert (project / "thesis.tex").read_text() == "draft" and (project / "code" / "run.py").is_file()


def test_force_replaces_an_output_but_not_the_files_added_to_it(capsys, pair, text_file, tmp_path):
    out = tmp_path / "out"
    assert run(capsys, *merge_args(pair, text_file, out))[0] == 0
    recorded = json.loads((out / MANIFEST).read_text())["files"]
    assert {"barrier.json", "model.safetensors", "README.md"} <= set(recorded) and MANIFEST not in recorded
    assert run(capsys, *merge_args(pair, text_file, out, "--force"))[0] == 0  # its own output: replaced
    (out / "NOTES.txt").write_text("mine")
    (out / "extra").mkdir()
    refused(capsys, *merge_args(pair, text_file, out, "--force"), naming="NOTES.txt")
    (out / "NOTES.txt").unlink()
    (out / "README.md").write_text("edited by hand")
    refused(capsys, *merge_args(pair, text_file, out, "--force"), naming="README.md (changed)")
    assert (out / "README.md").read_text() == "edited by hand" and (out / "extra").is_dir()


def test_force_over_an_output_of_an_earlier_version(capsys, pair, text_file, tmp_path):
    """No manifest: replaced when it holds only the names a merge writes, refused otherwise."""
    out = tmp_path / "old"
    assert run(capsys, *merge_args(pair, text_file, out))[0] == 0
    (out / MANIFEST).unlink()
    assert run(capsys, *merge_args(pair, text_file, out, "--force"))[0] == 0
    (out / MANIFEST).unlink()
    (out / "thesis.tex").write_text("draft")
    refused(capsys, *merge_args(pair, text_file, out, "--force"), naming="thesis.tex")
    assert (out / "thesis.tex").read_text() == "draft"


def test_out_never_inside_the_data(capsys, pair, text_file, tmp_path):
    data = tmp_path / "texts"
    data.mkdir()
    shutil.copy(text_file, data / "a.txt")
    refused(capsys, *merge_args(pair, data, data / "out"), naming="data")
    refused(capsys, *merge_args(pair, text_file, pair[1] / "out"), naming="source model")
    assert sorted(p.name for p in data.iterdir()) == ["a.txt"] and not (pair[1] / "out").exists()


WRITERS = {  # each writer, given the place it writes to
    "merge --out": lambda pair, data, place: merge_args(pair, data, place / "out"),
    "barrier --json": lambda pair, data, place: barrier_args(pair, data, "--json", place / "r.json"),
    "tokenize --out": lambda pair, data, place: ["tokenize", data, "--model", pair[0], "--out", place / "t.npy"],
    "--self-samples-dir": lambda pair, data, place: [*merge_args(pair, data, "out"), "--method", "lm",
                                                     "--self-samples-dir", place / "ss"],
    "--checkpoint-dir": lambda pair, data, place: [*merge_args(pair, data, "out"), "--method", "lm",
                                                   "--train-data", data, "--allow-train-on-eval",
                                                   "--checkpoint-dir", place / "ck"],
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("target", ["source model", "data"])
def test_no_writer_writes_into_a_source_model_or_the_data(capsys, pair, text_file, tmp_path, writer, target):
    data = tmp_path / "texts"  # a --data folder
    data.mkdir()
    shutil.copy(text_file, data / "a.txt")
    place = pair[0] if target == "source model" else data  # model A: a source of every writer
    before = hashes(pair[0], data)
    line = refused(capsys, *WRITERS[writer](pair, data, place), naming=target)
    assert writer.split()[-1] in line
    assert hashes(pair[0], data) == before and sorted(p.name for p in data.iterdir()) == ["a.txt"]


# --- every place written is proven writable before the work (repro 5) --------------------------------

@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A read-only folder `ro` (as a read-only mount would be): root may write anywhere, so for root os.access
    answers as it would for an ordinary user."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        resolved = Path(path).absolute().resolve()
        if mode & os.W_OK and (resolved == folder or folder in resolved.parents):
            return False
        return real_access(path, mode, *args, **kwargs)
    if os.geteuid() == 0:
        monkeypatch.setattr(os, "access", access)
    yield folder
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)


@pytest.fixture
def no_loading(monkeypatch):
    from hf_rebasin.sources import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output place was checked")
    monkeypatch.setattr(models, "load", refuse)


@pytest.mark.parametrize("case", ["tokenize --out", "--self-samples-dir", "--checkpoint-dir"])
def test_unwritable_places_are_refused_before_the_work(capsys, pair, text_file, read_only, no_loading, tmp_path,
                                                       case):
    read_only.chmod(0o555)
    lm = ["merge", pair[0], pair[1], "--data", text_file, "--method", "lm", "--steps", "2", *FAST,
          "--out", tmp_path / "out"]
    argv = {"tokenize --out": ["tokenize", text_file, "--model", pair[0], "--out", read_only / "t.npy"],
            "--self-samples-dir": [*lm, "--self-samples-dir", read_only / "ss"],
            "--checkpoint-dir": [*lm, "--train-data", text_file, "--allow-train-on-eval", "--checkpoint-dir",
                                 read_only / "ck"]}[case]
    refused(capsys, *argv, naming=case.split()[-1])
    assert list(read_only.iterdir()) == [] and not (tmp_path / "out").exists()


def test_a_read_only_sample_cache_is_refused_before_sampling(capsys, pair, text_file, read_only, tmp_path,
                                                              monkeypatch):
    """A cache folder that holds samples is let through the first checks (they may be reused); when they cannot
    be, it is refused before anything is sampled."""
    from hf_rebasin.sources import self_samples

    def sample(*args, **kwargs):
        raise AssertionError("sampled before the cache folder was checked")
    monkeypatch.setattr(self_samples, "interleaved", sample)
    (read_only / "self-0123456789abcdef.npy").write_bytes(b"of other settings")
    read_only.chmod(0o555)
    code, err = run(capsys, "merge", pair[0], pair[1], "--data", text_file, "--method", "lm", "--steps", "2", *FAST,
                    "--out", tmp_path / "out", "--self-samples-dir", read_only)
    last = err.strip().splitlines()[-1]  # after the note that the run trains on samples of the models
    assert code == 2 and "Traceback" not in err and "--self-samples-dir" in last and "not writable" in last, err
    assert [p.name for p in read_only.iterdir()] == ["self-0123456789abcdef.npy"]


@pytest.fixture
def read_only_output(read_only, pair):
    from hub_server import write_merge_output
    out = read_only / "prev"
    shutil.copytree(pair[0], out)
    write_merge_output(out)
    out.chmod(0o555)
    read_only.chmod(0o555)
    return out


def test_eval_and_push_of_an_unwritable_output_are_refused_before_the_work(capsys, read_only_output, monkeypatch,
                                                                          tmp_path):
    from hub_server import FakeHub, use_fake_hub

    from hf_rebasin.hub import evals
    before = hashes(read_only_output)

    def evaluate(*args, **kwargs):
        raise AssertionError("evaluated before the output folder was checked")
    monkeypatch.setattr(evals, "evaluate_source", evaluate)
    monkeypatch.setattr(evals, "prepare_tasks", evaluate)
    refused(capsys, "eval", read_only_output, naming="not writable")
    with FakeHub(lifetime_s=60) as hub:
        use_fake_hub(monkeypatch, hub, tmp_path)
        refused(capsys, "push", read_only_output, "someuser/ro", naming="not writable")
        assert hub.repos == {}
    assert hashes(read_only_output) == before


# --- eval.json: merged, and published without local paths (repro 6) -----------------------------------

def fake_outcome(label_scores: dict):
    from hf_rebasin.hub import evals

    def evaluate_source(source, task_set, **kwargs):
        return evals.Outcome({task: {"acc": label_scores[Path(source).name]} for task in task_set.names},
                             dict.fromkeys(task_set.names, 3), 0.1)
    return evaluate_source


def test_second_eval_keeps_the_endpoint_columns(capsys, tmp_path, pair, monkeypatch):
    """The scores themselves are lm-eval's (tests/test_evals.py); here only what eval.json keeps."""
    from hub_server import write_merge_output

    from hf_rebasin.hub import evals
    out = tmp_path / "merged"
    shutil.copytree(pair[0], out)
    a, b = (shutil.copytree(pair[0], tmp_path / name) for name in ("a", "b"))
    write_merge_output(out, models=[str(a), str(b)])
    monkeypatch.setattr(evals, "prepare_tasks", lambda tasks, paths: evals.TaskSet(evals.parse_task_names(tasks),
                                                                                     None))
    monkeypatch.setattr(evals, "evaluate_source", fake_outcome({"merged": 0.6, "a": 0.7, "b": 0.8}))
    assert run(capsys, "eval", out, "--tasks", "piqa", "--endpoints")[0] == 0
    assert run(capsys, "eval", out, "--tasks", "piqa,sciq")[0] == 0
    evaluation = json.loads((out / "eval.json").read_text())
    assert list(evaluation["results"]) == ["merged", "A", "B"]
    assert evaluation["results"]["A"] == {"piqa": {"acc": 0.7}} and evaluation["results"]["B"]["piqa"]["acc"] == 0.8
    assert evaluation["results"]["merged"] == {"piqa": {"acc": 0.6}, "sciq": {"acc": 0.6}}
    assert evaluation["tasks"] == ["piqa", "sciq"] and evaluation["models"]["A"] == str(a)
    assert run(capsys, "eval", out, "--tasks", "piqa", "--limit", "2")[0] == 0  # another protocol: not mixed
    assert list(json.loads((out / "eval.json").read_text())["results"]) == ["merged"]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from hub_server import FakeHub, use_fake_hub
    with FakeHub(lifetime_s=120) as server:
        use_fake_hub(monkeypatch, server, tmp_path)
        yield server


def test_nothing_local_is_pushed(capsys, pair, text_file, tmp_path, hub, monkeypatch):
    from hf_rebasin.hub import evals
    out = tmp_path / "out" / "wm"
    assert run(capsys, *merge_args(pair, text_file, out))[0] == 0
    monkeypatch.setattr(evals, "prepare_tasks", lambda tasks, paths: evals.TaskSet(evals.parse_task_names(tasks),
                                                                                     None))
    monkeypatch.setattr(evals, "evaluate_source", fake_outcome({"wm": 0.6, "model-a": 0.7, "model-b": 0.8}))
    assert run(capsys, "eval", "out/wm", "--tasks", "piqa", "--endpoints")[0] == 0
    local = json.loads((out / "eval.json").read_text())
    assert local["models"]["A"] == str(pair[0]) and local["models"]["merged"] == "out/wm"  # the local record
    assert run(capsys, "push", "out/wm", "someuser/x")[0] == 0
    remote = hub.files("someuser/x")
    assert json.loads(remote["eval.json"])["models"] == {"merged": "x", "A": "model-a", "B": "model-b"}
    assert MANIFEST not in remote and "eval.json" in remote
    for name, content in remote.items():
        for local_path in (str(tmp_path), str(pair[0].parent), str(pair[1].parent), str(Path.home()), "out/wm"):
            assert local_path.encode() not in content, (name, local_path)
    recorded = json.loads((out / MANIFEST).read_text())["files"]  # eval and push updated the record
    assert recorded["eval.json"] == (out / "eval.json").stat().st_size
    assert recorded["README.md"] == (out / "README.md").stat().st_size
    assert run(capsys, *merge_args(pair, text_file, out, "--force"))[0] == 0  # so it is still all hf-rebasin's


def test_a_local_path_in_any_uploaded_file_is_refused(capsys, tmp_path, pair, hub):
    from hub_server import write_merge_output
    out = tmp_path / "merged"
    shutil.copytree(pair[0], out)
    write_merge_output(out)
    (out / "notes.txt").write_text(f"trained in {tmp_path}/runs\n")
    refused(capsys, "push", out, "someuser/leak", naming="notes.txt names the local path")
    assert hub.repos == {}


def test_a_runs_recipe_copy_is_published_without_local_paths(tmp_path, pair, hub):
    import yaml
    from hub_server import write_merge_output

    from hf_rebasin.hub.push import push
    out = tmp_path / "merged"
    shutil.copytree(pair[0], out)
    write_merge_output(out)
    recipe = tmp_path / "recipes" / "tiny.yaml"
    (out / "recipe.yaml").write_text(f"# the recipe this folder was made with: hf-rebasin run {recipe}\n"
                                     f"# from {recipe}\n"
                                     f"merge: {{models: [{pair[0]}, org/b], out: {out}}}\n"
                                     f"eval: {{include_path: {tmp_path / 'tasks'}}}\n")
    push(out, "someuser/recipe")
    published = hub.files("someuser/recipe")["recipe.yaml"].decode()
    assert str(tmp_path) not in published and str(pair[0].parent) not in published
    assert yaml.safe_load(published) == {"merge": {"models": ["model-a", "org/b"], "out": "merged"},
                                         "eval": {"include_path": "tasks"}}
    assert published.startswith("# the recipe this folder was made with: hf-rebasin run tiny.yaml\n# from tiny.yaml")


# --- push: no empty repo left behind, no false "nothing half-written" ---------------------------------

def test_push_interrupted_after_creating_the_repo(capsys, tmp_path, pair, hub, monkeypatch):
    from hub_server import write_merge_output
    from huggingface_hub import HfApi
    out = tmp_path / "merged"
    shutil.copytree(pair[0], out)
    write_merge_output(out)

    real_upload, cut = HfApi.upload_folder, [True]

    def upload_folder(self, *args, **kwargs):
        if cut[0]:
            raise KeyboardInterrupt
        return real_upload(self, *args, **kwargs)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    code, err = run(capsys, "push", out, "someuser/cut")
    assert code == 130 and "someuser/cut" not in hub.repos  # the repo it created is gone: nothing half-written
    hub.fail("delete", 500)
    code, err = run(capsys, "push", out, "someuser/cut")
    assert code == 2 and "half-written" not in err and "someuser/cut" in hub.repos
    assert "created, empty" in err and err.strip().endswith("someuser/cut --exist-ok")
    hub.failures.clear()
    cut[0] = False
    assert run(capsys, "push", out, "someuser/cut", "--exist-ok")[0] == 0  # the retry it printed works
    assert "model.safetensors" in hub.files("someuser/cut")
