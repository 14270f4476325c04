"""``hf-rebasin run RECIPE``: the bundled recipes validate, bad recipes are refused with a message that
names the problem, and a recipe runs merge -> eval -> push end to end on tiny local models (eval on a local
lm-eval task, push to the fake Hub of tests/hub_server.py), with a resume hint when a step fails."""
from __future__ import annotations

import dataclasses
import json
import shlex
import textwrap
from pathlib import Path

import corpus
import pytest
import yaml
from conftest import REPO
from hub_server import FakeHub, use_fake_hub

from hf_rebasin import tiny
from hf_rebasin.assets import asset, example_pair
from hf_rebasin.cli import build_parser, main
from hf_rebasin.hub import recipe_checks, recipes
from hf_rebasin.match import METHODS
from hf_rebasin.option_fields import from_namespace, option_table
from hf_rebasin.options import EvalOptions, MergeOptions, PushOptions, TokenizeOptions

TABLE_5_PAIRS = {  # Li & Shen Table 5 (ViT-L left out: timm has no augreg_in1k twin) + the from-scratch pairs
    **{f"pythia-{s}": (f"EleutherAI/pythia-{s}", f"EleutherAI/pythia-{s}-deduped")
       for s in ("14m", "31m", "70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b")},
    "fineweb-edu-pile": ("HuggingFaceFW/ablation-model-fineweb-edu", "HuggingFaceFW/ablation-model-the-pile"),
    "olmo-7b-twin": ("allenai/OLMo-7B-hf", "allenai/OLMo-7B-Twin-2T-hf"),
    "vit-small": ("timm/vit_small_patch16_224.augreg_in21k_ft_in1k", "timm/vit_small_patch16_224.augreg_in1k"),
    "vit-base": ("timm/vit_base_patch16_224.augreg_in21k_ft_in1k", "timm/vit_base_patch16_224.augreg_in1k"),
    "example-stdlib": ("example-pair/model-a", "example-pair/model-b"),
    # the PolyPythias: the same data, different seeds (seed 1 vs seed 2; --set models=... for other seeds)
    **{f"polypythia-{s}": (f"EleutherAI/pythia-{s}-seed1", f"EleutherAI/pythia-{s}-seed2")
       for s in ("14m", "31m", "70m", "160m", "410m")},
    # the seed families (hf_rebasin/hub/seed_families.py; tests/test_seed_families.py)
    "multiberts": ("google/multiberts-seed_0", "google/multiberts-seed_1"),
    "crfm-gpt2-small": ("stanford-crfm/alias-gpt2-small-x21", "stanford-crfm/battlestar-gpt2-small-x49"),
    "crfm-gpt2-medium": ("stanford-crfm/arwen-gpt2-medium-x21", "stanford-crfm/beren-gpt2-medium-x49"),
    "polypythia-160m-data-seed": ("EleutherAI/pythia-160m-data-seed1", "EleutherAI/pythia-160m-data-seed2"),
    "polypythia-160m-weight-seed": ("EleutherAI/pythia-160m-weight-seed1", "EleutherAI/pythia-160m-weight-seed2"),
}
LEARNED_RECIPES = {"pythia-1b", "pythia-1.4b", "pythia-2.8b", "pythia-6.9b", "fineweb-edu-pile",
                   "olmo-7b-twin"}  # the pairs of 1B parameters and more
LOCAL_BENCHMARK_PAIRS = {name: (f"../../runs/pairs/{name}/model-a", f"../../runs/pairs/{name}/model-b")
                         for name in ("gpt2-shakespeare", "neox-shakespeare", "vit-digits")}
EXAMPLE_PAIR = example_pair()
BENCHMARK_RECIPES = REPO / "benchmarks" / "recipes"  # pairs trained by benchmarks/pairs.py (clone only)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny GPT-NeoX checkpoints (char-level tokenizer) and a slice of held-out stdlib source."""
    root = tmp_path_factory.mktemp("pair")
    tiny.make_tiny("gpt_neox", root / "model-a", seed=0)
    tiny.make_tiny("gpt_neox", root / "model-b", seed=1)
    (root / "heldout.txt").write_text(corpus.heldout_text(20000))
    return root


def write_recipe(folder: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def tiny_recipe(tmp_path: Path, pair: Path, extra: str = "") -> Path:
    return write_recipe(tmp_path, textwrap.dedent(f"""\
        description: tiny pair
        models: [{pair / 'model-a'}, {pair / 'model-b'}]
        method: wm
        data: {pair / 'heldout.txt'}
        merge:
          seq_len: 32
          max_eval_tokens: 2048
          lambdas: 5
        out: merged
        """) + textwrap.dedent(extra))


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(["run", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- the bundled recipes ---------------------------------------------------------------------------

def test_bundled_recipes_cover_the_pairs():
    assert set(recipes.bundled()) == set(TABLE_5_PAIRS)


@pytest.mark.parametrize("name", sorted(TABLE_5_PAIRS))
def test_bundled_recipe_validates_and_builds_valid_commands(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # validation must not need the Hub
    monkeypatch.chdir(tmp_path)
    recipe = recipes.load_recipe(name, check_paths=False)
    # packaged: inputs from the package's assets, the output folder from the current folder
    assert recipe.path == recipes.RECIPES_DIR / f"{name}.yaml" and recipe.base == asset()
    assert recipe.out_base == tmp_path
    assert tuple(recipe.fields["models"]) == TABLE_5_PAIRS[name]
    assert recipe.fields.get("method", "wm") in METHODS
    steps = recipes.commands(recipe)
    parser = build_parser()
    merge = parser.parse_args(steps["merge"])
    hub_ids = [m for m in TABLE_5_PAIRS[name] if not m.startswith("example-pair/")]
    assert merge.models[:len(hub_ids)] == hub_ids  # Hub ids pass through untouched
    assert Path(merge.out).resolve() == (tmp_path / recipe.fields["out"]).resolve()
    if "eval" in steps:
        evaluated = parser.parse_args(steps["eval"])
        assert Path(evaluated.dir).resolve() == Path(merge.out).resolve()
        assert evaluated.tasks == "piqa,sciq,arc_easy" and evaluated.endpoints
    assert "push" not in steps  # a bundled recipe never uploads to somebody's account by default
    if name in LEARNED_RECIPES:  # Li & Shen's budget, on a token file written first with the first model's tokenizer
        assert recipe.fields["method"] == "dual"
        tokenize = parser.parse_args(steps["tokenize"])
        assert tokenize.model == hub_ids[0] and merge.train_data == tokenize.out
        assert (merge.steps, merge.learn_batch_size, merge.seq_len) == (20000, 16, 512)
        assert tokenize.max_tokens >= merge.steps * merge.learn_batch_size * merge.seq_len
        processes = recipes.num_processes(recipe.fields)
        assert merge.fsdp == (processes > 1) and recipes.launcher(recipe)[:2] == (["accelerate", "launch"]
                                                                                   if processes > 1 else [])
    else:
        assert "tokenize" not in steps


def test_example_recipe_reads_the_packaged_pair():
    recipe = recipes.load_recipe("example-stdlib")  # checks that its inputs exist
    steps = recipes.commands(recipe)
    merge = build_parser().parse_args(steps["merge"])
    assert [Path(m).resolve() for m in merge.models] == [EXAMPLE_PAIR / "model-a", EXAMPLE_PAIR / "model-b"]
    assert Path(merge.data).resolve() == EXAMPLE_PAIR / "heldout.txt"


@pytest.mark.parametrize("name", sorted(LOCAL_BENCHMARK_PAIRS))
def test_benchmark_recipes_check_their_folders(name):
    path = BENCHMARK_RECIPES / f"{name}.yaml"
    models = [(BENCHMARK_RECIPES / m).resolve() for m in LOCAL_BENCHMARK_PAIRS[name]]
    assert tuple(recipes.read_yaml(path)["models"]) == LOCAL_BENCHMARK_PAIRS[name]
    if all(m.is_dir() for m in models):
        assert recipes.load_recipe(path).fields["models"]
        return
    with pytest.raises(recipes.UserError, match="does not exist") as error:
        recipes.load_recipe(path)
    assert recipes.read_yaml(path)["prepare"] in str(error.value)


def test_list(capsys):
    assert main(["run", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines[1:-1]}
    assert set(listed) == set(TABLE_5_PAIRS)
    assert "Pythia-1B vs Pythia-1B-deduped" in listed["pythia-1b"]


# --- validation ------------------------------------------------------------------------------------------

BAD = {
    "unknown field": ("modles: [a, b]\n", ["unknown field 'modles'", "did you mean 'models'?", "allowed: description,",
                                          "`models` is missing"]),
    "missing models": ("method: wm\n", ["`models` is missing"]),
    "one model": ("models: [a]\n", ["`models` lists 1 model; a merge needs two or more"]),
    "models not a list": ("models: a b\n", ["`models` must be a list, got 'a b' (str)"]),
    "bad method": ("models: [a, b]\nmethod: wn\n", ["unknown method 'wn' (did you mean 'wm'?)", "raw, wm, wm-perm"]),
    "bad type": ("models: [a, b]\nmerge: {alpha: half, lambdas: 2.5}\n",
                 ["`merge.alpha` must be a number, got 'half' (str)", "`merge.lambdas` must be an integer, got 2.5"]),
    "bad flag": ("models: [a, b]\neval: {endpoints: maybe}\n", ["`eval.endpoints` must be true or false"]),
    "bad choice": ("models: [a, b]\nmerge: {orth: qr}\n", ["`merge.orth` must be one of cayley, expm, got 'qr'"]),
    "bad device": ("models: [a, b]\neval: {device: tpu}\n",
                   ["`eval.device` 'tpu' is not a device hf-rebasin runs on: use auto, cpu, cuda or cuda:N"]),
    "out of range": ("models: [a, b]\nmerge: {lambdas: 1, lr: 0}\neval: {limit: 0}\n",
                     ["has 3 problems", "`merge.lambdas` must be in [3, 1001], got 1",
                      "`merge.lr` must be in (0.0, 1.0], got 0.0", "`eval.limit` must be at least 1, got 0"]),
    "options that do not go together": (
        "models: [a, b, c]\nmerge: {alpha: 0.3, warmup: 50, steps: 10}\neval: {batch_size: lots}\n",
        ["has 2 problems", "`merge.alpha` is for two models; 3 models are merged at their centroid",
         "`merge.warmup` must be in [0, `merge.steps`), got 50 with `merge.steps` 10",
         "`eval.batch_size` 'lots' must be a positive integer or 'auto'"]),
    "a method that cannot merge three": ("models: [a, b, c]\nmethod: am\n",
                                         ["`method` am is not available for 3 models; use one of"]),
    "unknown option": ("models: [a, b]\nmerge: {max_eval_token: 10}\n",
                       ["unknown field in `merge`: 'max_eval_token' (did you mean 'max_eval_tokens'?)"]),
    "option of the wrong block": ("models: [a, b]\nmerge: {out: x, private: true}\n",
                                  ["`merge.out` is not set in the `merge` block: it is the top-level field `out`",
                                   "`merge.private` is not set in the `merge` block: it belongs in the `push` block"]),
    "push without repo": ("models: [a, b]\npush: {private: true}\n", ["the `push` block needs `repo_id`"]),
    "bad paper": ("models: [a, b]\npaper: {barrier: {wm: high}, sorce: x}\n",
                  ["`paper.barrier.wm` must be a number",
                   "unknown field in `paper`: 'sorce' (did you mean 'source'?)"]),
    "duplicate key": ("models: [a, b]\nmethod: wm\nmethod: raw\n", ["the key 'method' is written twice"]),
    "not yaml": ("models: [a, b\n", ["is not valid YAML"]),
    "not a mapping": ("- a\n- b\n", ["must be a mapping of fields"]),
    "missing local folder": ("models: [./nowhere-a, ./nowhere-b]\ndata: ./nothing.txt\n",
                             ["has 3 problems", "the local model folder nowhere-a does not exist",
                              "`data`: nothing.txt does not exist"]),
    "missing task folder": ("models: [EleutherAI/pythia-14m, EleutherAI/pythia-14m-deduped]\n"
                            "eval: {include_path: my-tasks}\n", ["`eval.include_path`: my-tasks does not exist"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_exits_2_with_the_problem(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text, messages = BAD[case]
    path = write_recipe(tmp_path, text)
    code, out, err = run([path], capsys)
    assert code == 2, (out, err)
    assert err.startswith("hf-rebasin run: error: ")
    for message in messages:
        assert message in err
    assert not (tmp_path / "runs").exists()


def test_unknown_recipe_name_suggests_a_bundled_one(capsys):
    code, _, err = run(["pythia-1bb"], capsys)
    assert code == 2
    assert "no recipe file pythia-1bb and no bundled recipe of that name (did you mean pythia-1b" in err


def test_set_overrides_and_is_checked(tmp_path, pair, capsys):
    path = tiny_recipe(tmp_path, pair)
    recipe = recipes.load_recipe(path, ["merge.alpha=0.25", "method=raw", "push.repo_id=someuser/x", "eval=null"])
    steps = recipes.commands(recipe)
    assert steps["merge"][steps["merge"].index("--alpha") + 1] == "0.25"
    assert steps["merge"][steps["merge"].index("--method") + 1] == "raw"
    assert steps["push"][:3] == ["push", str(tmp_path / "merged"), "someuser/x"] and "eval" not in steps
    code, _, err = run([path, "--set", "merge.rounds=many"], capsys)
    assert code == 2 and "`merge.rounds` must be an integer, got 'many'" in err
    code, _, err = run([path, "--set", "merge"], capsys)
    assert code == 2 and "--set expects KEY=VALUE" in err


ONE_PROCESS_REFUSES = {"fsdp"}  # refused without launch.num_processes > 1 (next test)


def test_a_recipe_asking_for_fsdp_needs_more_than_one_process(tmp_path, pair):
    fields = {"models": [str(pair / "model-a"), str(pair / "model-b")], "data": str(pair / "heldout.txt"),
              "method": "dual", "merge": {"fsdp": True, "learn_batch_size": 8}}
    path = write_recipe(tmp_path, yaml.safe_dump(fields))
    with pytest.raises(recipes.UserError, match="merge.fsdp.*launch.num_processes"):
        recipes.load_recipe(path)
    assert recipes.load_recipe(path, ["launch.num_processes=2"]).fields["launch"] == {"num_processes": 2}
    # the options' own checks see the processes: the batch must divide among them
    with pytest.raises(recipes.UserError, match="not divisible by `merge.grad_accum` .1. × processes .3."):
        recipes.load_recipe(path, ["launch.num_processes=3"])
    for bad, message in (("launch.num_processes=0", "`launch.num_processes` must be at least 1, got 0"),
                         ("launch.gpus=2", "unknown field in `launch`: 'gpus'"),
                         ("launch=4", "`launch` must be a mapping")):
        with pytest.raises(recipes.UserError, match=message):
            recipes.load_recipe(path, [bad])


def dual_recipe(tmp_path: Path, pair: Path, extra: str = "") -> Path:
    """A dual recipe that tokenises its training text first (the first model's tokenizer)."""
    (tmp_path / "train.txt").write_text(corpus.train_text(30000))
    block = f"tokenize: {{data: {tmp_path / 'train.txt'}, out: tokens/train.npy, max_tokens: 20000}}\n"
    return tiny_recipe(tmp_path, pair, block + textwrap.dedent(extra))


def test_tokenize_step_and_launch_in_the_dry_run(tmp_path, pair, capsys):
    path = dual_recipe(tmp_path, pair, "launch: {num_processes: 2}\n")
    overrides = ["--set", "method=dual", "--set", "merge.steps=3000", "--set", "merge.learn_batch_size=16"]
    code, out, err = run([path, "--dry-run", *overrides], capsys)
    assert code == 0, err
    lines = out.splitlines()
    token_file = tmp_path / "tokens" / "train.npy"
    assert lines[1] == (f"hf-rebasin tokenize {tmp_path / 'train.txt'} --model {pair / 'model-a'} --out {token_file} "
                        "--max-tokens 20000")
    assert lines[2].startswith("accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
                               "--dynamo_backend no -m hf_rebasin.cli merge ")
    merge = build_parser().parse_args(shlex.split(lines[2].split(" -m hf_rebasin.cli ")[1]))
    assert merge.train_data == str(token_file) and merge.method == "dual" and merge.steps == 3000
    from hf_rebasin.describe import describe
    from hf_rebasin.hub.budget import TrainingBudget
    facts = describe(str(pair / "model-a"))
    expected = TrainingBudget(facts["parameters"], facts["d_model"], 3000, 16, 32, 2, False)
    assert expected.tokens == 3000 * 16 * 32
    assert f"# learned matching: {expected.summary()}" in lines
    assert "1,536,000 training tokens" in out and "h on 2 GPUs" in out
    assert not token_file.parent.exists()  # a dry run writes nothing
    code, out, _ = run([path, "--dry-run"], capsys)  # method wm: nothing to train on, no budget
    assert "# tokenize: skipped (method wm does not train)" in out and "--train-data" not in out
    assert "learned matching" not in out
    code, out, _ = run([path, "--dry-run", *overrides, "--skip-merge"], capsys)  # nothing would read the file
    assert "# tokenize: skipped (the merge is skipped)" in out and "hf-rebasin tokenize" not in out
    with pytest.raises(recipes.UserError, match="both name the training data"):
        recipes.load_recipe(path, ["merge.train_data=other.npy"])
    with pytest.raises(recipes.UserError, match="`tokenize.out` must name a .npy file"):
        recipes.load_recipe(path, ["tokenize.out=tokens.bin"])


def test_an_existing_token_file_is_kept_only_when_it_holds_what_the_block_asks(tmp_path, pair, capsys):
    import hf_rebasin
    path = dual_recipe(tmp_path, pair)
    recipe = recipes.load_recipe(path, ["method=dual"])
    hf_rebasin.tokenize(str(tmp_path / "train.txt"), str(pair / "model-a"), recipe.token_file, max_tokens=20000,
                        progress=False)
    assert recipes.token_file_problem(recipe) is None
    code, out, _ = run([path, "--dry-run", "--set", "method=dual"], capsys)
    assert code == 0 and f"# tokenize: skipped ({recipe.token_file} already holds this data" in out
    assert "\nhf-rebasin tokenize" not in out and f"--train-data {recipe.token_file}" in out
    for change in ("tokenize.max_tokens=10000", "tokenize.text_field=body", "tokenize.split=test",
                   f"models=[{pair / 'model-b'}, {pair / 'model-a'}]"):
        problem = recipes.token_file_problem(recipes.load_recipe(path, ["method=dual", change]))
        assert "was not made by this recipe's `tokenize` block" in problem, change


def test_the_budget_arithmetic():
    from hf_rebasin.hub.budget import TrainingBudget
    budget = TrainingBudget(params=10**9, d_model=2048, steps=20000, batch=16, seq_len=512)
    assert budget.tokens == 163_840_000
    assert budget.flops == pytest.approx(6e9 * 163_840_000 * (1 + 2 * 2048 / (3 * 8192)))
    assert budget.gpu_hours == pytest.approx(budget.flops / (154.8e12 * 0.4) / 3600)
    assert 5.0 < budget.gpu_hours < 5.3  # ≈ 5.1 GPU-hours for a 1B pair at Li & Shen's batch
    recomputed = TrainingBudget(params=10**9, d_model=2048, steps=20000, batch=16, seq_len=512, checkpointing=True)
    assert recomputed.flops == pytest.approx(budget.flops * 8 / 6)  # one more forward per step


def test_a_recipe_tokenises_then_trains_sharded_over_two_processes(tmp_path, pair, capsys, monkeypatch):
    """The whole learned-matching recipe on CPUs: the token file is written, the merge runs under `accelerate launch`
    over two processes with FSDP and trains on it (memory-mapped); a rerun keeps the token file; a token file made
    from other data is refused before anything runs."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    path = dual_recipe(tmp_path, pair, "launch: {num_processes: 2}\n")
    settings = ["--set", "method=dual", "--set", "merge.steps=4", "--set", "merge.learn_batch_size=4",
                "--set", "merge.fsdp=true", "--set", "merge.gradient_checkpointing=true", "--set", "merge.lambdas=3",
                "--set", "merge.eval_every=0"]
    code, out, err = run([path, *settings], capsys)
    assert code == 0, err
    assert "== step 1/2: tokenize: hf-rebasin tokenize" in out and "== step 2/2: merge: accelerate launch" in out
    token_file = tmp_path / "tokens" / "train.npy"
    assert json.loads(token_file.with_name("train.npy.json").read_text())["tokens"] == 20000
    barrier = json.loads((tmp_path / "merged" / "barrier.json").read_text())
    assert barrier["method"] == "dual"
    learned = barrier["settings"]
    assert learned["train_data"]["memory_mapped"] and learned["train_data"]["spec"] == str(token_file)
    storage = learned["endpoint_storage"]  # FSDP over the two processes: each stores half the endpoints
    assert learned["num_processes"] == 2
    assert 0.5 * storage["bytes_total"] <= storage["bytes_per_process"] <= 0.55 * storage["bytes_total"]

    code, out, _ = run([path, "--dry-run", *settings], capsys)
    assert code == 0 and f"# tokenize: skipped ({token_file} already holds this data" in out
    (tmp_path / "other.txt").write_text(corpus.train_text(5000))
    code, out, err = run([path, *settings, "--force", "--set", f"tokenize.data={tmp_path / 'other.txt'}"], capsys)
    assert code == 2 and "exists but was not made by this recipe's `tokenize` block" in err and "== step" not in out


def test_every_option_is_a_recipe_key_that_reaches_its_command(tmp_path, pair):
    """The blocks take exactly the fields of the typed options (options.py): each one, set in its block, is
    accepted and comes out of commands() as the flag the real command line parses back to the same value."""
    blocks, expected = {}, {}
    for step, cls in recipe_checks.OPTIONS.items():
        keys = set(option_table(cls)) - set(recipe_checks.NOT_IN_BLOCK.get(step, {}))
        assert set(recipe_checks.block_keys(step)) == keys
        blocks[step] = {}
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if f.name in keys and default is not None and f.name not in ONE_PROCESS_REFUSES:
                blocks[step][f.name] = True if isinstance(default, bool) else default  # a flag: set
        expected[step] = cls(**blocks[step])
    blocks["push"]["repo_id"] = "someuser/x"
    blocks["tokenize"].update(data=str(pair / "heldout.txt"), out="tokens.npy")
    path = write_recipe(tmp_path, yaml.safe_dump({"models": [str(pair / "model-a"), str(pair / "model-b")],
                                                  "data": str(pair / "heldout.txt"), "out": "merged",
                                                  "method": "dual", **blocks}))
    steps, parser = recipes.commands(recipes.load_recipe(path)), build_parser()
    assert "--allow-train-on-eval" in steps["merge"]
    assert "--endpoints" in steps["eval"] and "--exist-ok" in steps["push"]
    merge = from_namespace(MergeOptions, parser.parse_args(steps["merge"]))
    assert merge.checkpoint_dir == str(tmp_path / "runs" / "learned")  # an output folder: from the recipe's folder
    assert merge == dataclasses.replace(expected["merge"], checkpoint_dir=merge.checkpoint_dir, method="dual",
                                        data=str(pair / "heldout.txt"), train_data=str(tmp_path / "tokens.npy"))
    tokenize = parser.parse_args(steps["tokenize"])  # the first model's tokenizer; the file from the recipe's folder
    assert (tokenize.data, tokenize.model, tokenize.out) == (str(pair / "heldout.txt"), str(pair / "model-a"),
                                                             str(tmp_path / "tokens.npy"))
    assert from_namespace(TokenizeOptions, tokenize) == expected["tokenize"]
    assert from_namespace(EvalOptions, parser.parse_args(steps["eval"])) == expected["eval"]
    assert from_namespace(PushOptions, parser.parse_args(steps["push"])) == expected["push"]


def test_recipes_module_is_library_code():
    """Reading and checking recipes needs no argparse and never exits: the command line is cli/recipe_command.py."""
    source = Path(recipes.__file__).read_text()
    assert "argparse" not in source and "SystemExit" not in source and "sys.exit" not in source
    with pytest.raises(recipes.UserError, match="`merge.lambdas` must be in"):
        recipes.load_recipe("example-stdlib", ["merge.lambdas=1"])


# --- running ---------------------------------------------------------------------------------------------

def test_dry_run_prints_the_commands_and_writes_nothing(tmp_path, pair, capsys):
    path = tiny_recipe(tmp_path, pair, "eval: {tasks: [a_task, b_task], limit: 4, endpoints: false}\n"
                                       "push: {repo_id: someuser/tiny, private: true}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run([path, "--dry-run"], capsys)
    assert code == 0, err
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    out_dir = str(tmp_path / "merged")
    assert commands == [
        f"hf-rebasin merge {pair / 'model-a'} {pair / 'model-b'} --method wm --data {pair / 'heldout.txt'} "
        f"--seq-len 32 --max-eval-tokens 2048 --lambdas 5 --out {out_dir}",
        f"hf-rebasin eval {out_dir} --tasks a_task,b_task --limit 4",
        f"hf-rebasin push {out_dir} someuser/tiny --private",
    ]
    for command in commands:  # each is a valid command line of the real CLI
        build_parser().parse_args(shlex.split(command)[1:])
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, out, _ = run([path, "--dry-run", "--skip-eval", "--skip-push"], capsys)
    assert "# eval: skipped (--skip-eval)" in out and "# push: skipped (--skip-push)" in out


def test_relative_paths_are_taken_from_the_recipe_folder(tmp_path, pair, capsys, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("model-a", "model-b", "heldout.txt"):
        (folder / name).symlink_to(pair / name)
    path = write_recipe(folder, "models: [model-a, model-b]\ndata: heldout.txt\nout: merged\n")
    monkeypatch.chdir(tmp_path)
    steps = recipes.commands(recipes.load_recipe(path))
    assert steps["merge"][1:3] == ["project/model-a", "project/model-b"]
    assert steps["merge"][steps["merge"].index("--data") + 1] == "project/heldout.txt"
    assert steps["merge"][-1] == "project/merged"
    # paths given with --set are command-line paths: taken from the current folder
    (tmp_path / "other.txt").write_text("some held-out text " * 50)
    recipe = recipes.load_recipe(path, ["data=other.txt", "out=elsewhere", "models=[project/model-b, someuser/x]"],
                                 check_paths=False)
    steps = recipes.commands(recipe)
    assert steps["merge"][1:3] == ["project/model-b", "someuser/x"]
    assert steps["merge"][steps["merge"].index("--data") + 1] == "other.txt" and steps["merge"][-1] == "elsewhere"


LOCAL_TASK = """\
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{goal}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2]}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_local_task(folder: Path) -> Path:
    folder.mkdir()
    rows = [{"goal": "To keep bread fresh,", "sol1": "seal it in a bag.", "sol2": "leave it in the sun.", "label": 0},
            {"goal": "To dry wet shoes,", "sol1": "fill them with water.", "sol2": "stuff them with paper.",
             "label": 1},
            {"goal": "To open a stuck lid,", "sol1": "run hot water over it.", "sol2": "freeze it.", "label": 0}]
    (folder / "tiny_choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny_choice.yaml").write_text(LOCAL_TASK.format(data=folder / "tiny_choice.jsonl"))
    return folder


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub(lifetime_s=120) as server:
        use_fake_hub(monkeypatch, server, tmp_path)
        yield server


def test_recipe_runs_merge_eval_push_and_resumes_after_a_failed_step(tmp_path, pair, hub, capsys, monkeypatch):
    tasks = write_local_task(tmp_path / "tasks")
    path = tiny_recipe(tmp_path, pair, f"""\
        eval: {{tasks: [tiny_choice], include_path: {tasks}, device: cpu, batch_size: 4}}
        push: {{repo_id: someuser/tiny-merge, private: true}}
        paper: {{source: a made-up paper, barrier: {{wm: 9.5}}}}
        """)
    hub.add_folder("someuser/tiny-merge", pair / "model-a", read_only=False)  # the repo exists: push will fail
    out = tmp_path / "merged"

    code, stdout, err = run([path, "--set", "merge.lambdas=3"], capsys)
    assert code == 2
    assert "== step 1/3: merge: hf-rebasin merge" in stdout and "== step 3/3: push:" in stdout
    assert "someuser/tiny-merge already exists; pass --exist-ok" in err
    resume = f"hf-rebasin run {path} --set merge.lambdas=3 --skip-merge --skip-eval"
    assert f"step push failed (see the error above); the merge in {out} is kept. Resume with: {resume}" in err
    assert f"or run the step alone: hf-rebasin push {out} someuser/tiny-merge --private" in err

    barrier = json.loads((out / "barrier.json").read_text())
    assert barrier["models"] == [str(pair / "model-a"), str(pair / "model-b")] and barrier["method"] == "wm"
    assert barrier["lambdas"] == [0.0, 0.5, 1.0] and barrier["data"]["seq_len"] == 32
    merge_line = next(line for line in stdout.splitlines() if line.startswith("== step 1/3"))
    assert merge_line.endswith(barrier["command"])  # the recipe ran exactly the command it printed
    evals = json.loads((out / "eval.json").read_text())
    assert evals["tasks"] == ["tiny_choice"] and 0.0 <= evals["results"]["merged"]["tiny_choice"]["acc"] <= 1.0
    assert yaml.safe_load((out / recipes.RECIPE_COPY).read_text())["merge"]["lambdas"] == 3

    code, _, err = run([path], capsys)  # a plain rerun does not silently redo or overwrite the merge
    assert code == 2 and "already holds a merge (barrier.json): pass --skip-merge" in err

    code, stdout, err = run(shlex.split(resume)[2:] + ["--set", "push.exist_ok=true"], capsys)
    assert code == 0, err
    assert "== step 1/1: push: hf-rebasin push" in stdout and stdout.count("== step") == 1
    remote = hub.files("someuser/tiny-merge")
    from hf_rebasin.hub.push import publishable_report
    assert remote["barrier.json"] == publishable_report(out).encode()  # local paths by their names
    assert {"eval.json", "recipe.yaml", "model.safetensors", "README.md"} <= set(remote)
    assert f"published barrier (a made-up paper): wm 9.5; this run (wm): {barrier['barrier']:.2f}" in stdout


def test_failed_merge_leaves_nothing_and_says_so(tmp_path, pair, capsys):
    path = tiny_recipe(tmp_path, pair)
    code, _, err = run([path, "--set", "merge.seq_len=4096", "--set", "merge.max_eval_tokens=8192"],
                       capsys)  # a window longer than the models' context
    assert code == 2
    assert "--seq-len 4096 is longer than the model's context" in err
    assert f"step merge failed (see the error above); nothing was written to {tmp_path / 'merged'}" in err
    assert not (tmp_path / "merged").exists()


def test_push_needs_a_token_before_anything_runs(tmp_path, pair, hub, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    path = tiny_recipe(tmp_path, pair, "push: {repo_id: someuser/x}\n")
    code, out, err = run([path], capsys)
    assert code == 2 and "no Hugging Face token" in err and "--skip-push" in err
    assert "== step" not in out and not (tmp_path / "merged").exists()


def test_example_stdlib_recipe_runs(tmp_path, capsys):
    code, _out, err = run(["example-stdlib", "--set", f"out={tmp_path / 'example'}",
                          "--set", "merge.max_eval_tokens=2048", "--set", "merge.lambdas=3"], capsys)
    assert code == 0, err
    barrier = json.loads((tmp_path / "example" / "barrier.json").read_text())
    assert barrier["method"] == "wm" and Path(barrier["data"]["spec"]).resolve() == EXAMPLE_PAIR / "heldout.txt"
    assert barrier["data"]["seq_len"] == 128 and barrier["data"]["input_tokens"] == 2048  # the recipe's and --set's
    assert [Path(m).resolve() for m in barrier["models"]] == [EXAMPLE_PAIR / "model-a", EXAMPLE_PAIR / "model-b"]


def test_polypythia_recipes_take_other_seeds(monkeypatch, tmp_path, capsys):
    """Any two of the nine seeds, by --set, without the Hub (validation reads no config)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["polypythia-70m", "--dry-run", "--set",
                          "models=[EleutherAI/pythia-70m-seed3, EleutherAI/pythia-70m-seed7]"], capsys)
    assert code == 0, err
    assert "merge EleutherAI/pythia-70m-seed3 EleutherAI/pythia-70m-seed7 --method wm" in out
