"""Typed options: every setting of merge / barrier, eval and push, its default, its help text and its valid
range, written once.  The command line (--help included) is generated from these dataclasses, recipes are
checked against them, and ``check`` refuses bad values before any expensive step, naming the flag.

    from hf_rebasin.options import MergeOptions
    MergeOptions(method="wm", data="heldout.txt", seq_len=128).check(n_models=2)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import comb

from .devices import device_problems, resolve_device
from .errors import OptionError, UserError
from .match.alignment import DEFAULT_HOLDOUT
from .option_fields import fields_of, flag_of, option, range_problems, value_type

DEFAULT_LM_DATA = "wikitext:wikitext-103-raw-v1:test"
DEFAULT_LAMBDAS = 11
DEFAULT_ALPHA = 0.5
MAX_LATTICE_POINTS = 500  # evaluations of an N-way merge's simplex lattice
LAMBDA_DISTRIBUTIONS = ("uniform", "narrow")

SELF_DATA = "self"  # --train-data / --match-data: sequences sampled from the models (sources/self_samples.py)
# lm/dual on language models without --train-data or --match-data train on `self` (BENCHMARKS.md, "Soft targets" and
# "self by default"); image models: --data split in halves (run_data.training_data)
DEFAULT_LEARNED_DATA: str | None = SELF_DATA
# `self` for lm/dual: an eighth of the windows the steps draw (each seen about 8 times) + the held-out ones; as close to
# a full pass as measured (within 0.004 nats on three long-trained pairs) for an eighth of the sampling
SELF_SAMPLE_SHARE = 8


def default_lambda_dist(method: str, n_models: int, task: str) -> str:
    """narrow, but dual on images or N models: uniform (BENCHMARKS.md, "What limits dual on the long pair")."""
    if method == "dual" and (n_models > 2 or task != "causal-lm"):
        return "uniform"
    return "narrow"


HARMLESS_WHEN_IGNORED = ("checkpoint_dir", "self_samples_dir",  # a place that is not used: warned about, not refused
                         "no_raw_reference")


# --- merge and barrier --------------------------------------------------------------------------------

EVALUATION = "evaluation (the barrier protocol)"
MATCHING = "matching"
LEARNED = "learned matching (--method lm / dual)"
OUTPUT = "output"
REFINE = "refinement after merging (--refine-steps)"
# the learned-matching options a refinement reads (match/refine.py: the same loop, data, checkpoints and precision)
REFINE_USES = ("learn_batch_size", "grad_accum", "train_data", "allow_train_on_eval", "max_train_tokens",
               "max_train_examples", "eval_every", "eval_subset", "holdout", "checkpoint_every", "checkpoint_minutes",
               "checkpoint_dir", "resume", "learn_seed", "learn_precision", "max_memory", "warmup")


@dataclass
class MergeOptions:
    """Everything `merge` and `barrier` take besides the models."""

    method: str = option("wm", "matching method (see the table in --help)", group=MATCHING)
    data: str | None = option(None, "held-out data: a .txt file or folder, .jsonl, a datasets spec "
                              f"NAME[:CONFIG[:SPLIT]] (LM default {DEFAULT_LM_DATA}); images: an ImageFolder, an "
                              ".npz or a datasets spec",
                              group=EVALUATION)
    text_field: str = option("text", "text field of .jsonl / datasets rows", group=EVALUATION)
    protocol: str = option("default", "evaluation protocol: default (documents joined by EOS, windows of --seq-len, "
                           "at most --max-eval-tokens) or li-shen (WikiText-103 test, rows joined by blank lines, "
                           "every 512-token window, no sliding window: docs/design.md §5)", group=EVALUATION,
                           choices=("default", "li-shen"))
    alpha: float | None = option(None, f"two models: the merged model is (1-α)·A + α·π(B) (default {DEFAULT_ALPHA})",
                                 group=EVALUATION, low=0.0, high=1.0)
    lambdas: int | None = option(None, f"two models: points on the λ grid from 0 to 1, at least 3 (2 would be the "
                                 f"endpoints alone) (default {DEFAULT_LAMBDAS})", group=EVALUATION, low=3, high=1001)
    simplex_resolution: int | None = option(None, "three or more models: lattice step 1/r on the simplex (default 6 "
                                            "for three models, else the largest r <= N whose lattice has at most "
                                            f"{MAX_LATTICE_POINTS} points)", group=EVALUATION, low=1)
    no_raw_reference: bool = option(False, "two models, a method other than raw: skip the plain average's barrier "
                                    "at the same λ points, printed and recorded (raw_barrier) as a reference; it costs "
                                    "about one more barrier evaluation", group=EVALUATION)
    seq_len: int | None = option(None, "window length in tokens (default min(512, context))", group=EVALUATION, low=2)
    max_eval_tokens: int = option(65536, "cap on evaluated tokens", group=EVALUATION, low=1)
    max_eval_examples: int | None = option(None, "cap on evaluated images (default all)", group=EVALUATION, low=1)
    batch_size: int = option(8, "evaluation batch size", group=EVALUATION, low=1)
    device: str = option("auto", "where models run: auto (a CUDA GPU when present), cpu, cuda or cuda:N",
                         group=EVALUATION)
    dtype: str = option("auto", "dtype of the merged checkpoint: auto (the sources' stored dtype), float32, bfloat16 "
                        "or float16 (arithmetic is fp32 throughout; the cast is the last step)", group=OUTPUT,
                        choices=("auto", "float32", "bfloat16", "float16"))
    max_shard_size: str = option("5GB", "largest safetensors shard of the merged checkpoint (e.g. 5GB, 500MB)",
                                 group=OUTPUT)
    rounds: int = option(10, "cap on weight-matching rounds", group=MATCHING, low=1, high=1000)
    match_data: str | None = option(None, f"data for activation matching (default: --data), or {SELF_DATA}: sampled "
                                    f"from the models (a folder named {SELF_DATA}: ./{SELF_DATA})", group=MATCHING)
    am_batches: int = option(32, "batches for activation matching", group=MATCHING, low=1)
    allow_overlap: bool = option(False, "proceed when over 1 %% of the evaluation tokens (images) are covered by a "
                                 "13-gram of the data the method fits on (refused otherwise; recorded in barrier.json)",
                                 group=MATCHING)
    # the self samples' settings (chosen from measurements: BENCHMARKS.md, "Self-sampled training data")
    self_temperature: float = option(1.0, f"temperature of the {SELF_DATA} samples", group=MATCHING, above=0, high=10)
    self_top_p: float = option(1.0, f"nucleus mass (top-p) of the {SELF_DATA} samples", group=MATCHING, above=0, high=1)
    self_samples_dir: str = option("runs/self-samples", f"cache folder of the {SELF_DATA} samples (token files, reused "
                                   "by a rerun with the same models and settings)", group=MATCHING)
    # learned matching
    steps: int = option(300, "optimiser steps", group=LEARNED, low=1, high=10_000_000)
    lr: float = option(3e-3, "AdamW learning rate (symmetry parameters are angles and log-scales; 1e-3 .. 1e-2 is "
                       "typical)", group=LEARNED, above=0.0, high=1.0)
    warmup: int | None = option(None, "linear warmup steps before the cosine decay (default 10%% of --steps)",
                                group=LEARNED, low=0)
    learn_batch_size: int = option(64, "examples per optimiser step, summed over processes and accumulation",
                                   group=LEARNED, low=1)
    grad_accum: int = option(1, "gradient accumulation micro-steps", group=LEARNED, low=1)
    init: str = option("absorbed", "absorbed: apply the weight-matching transforms first and learn from the identity; "
                       "plain: the parameters start at the weight-matching values", group=LEARNED,
                       choices=("absorbed", "plain"))
    orth: str = option("cayley", "orthogonal parameterisation", group=LEARNED, choices=("cayley", "expm"))
    inv: str = option("polar", "parameterisation of the per-head invertible maps", group=LEARNED,
                      choices=("polar", "expm", "direct"))
    lambda_dist: str | None = option(None, "λ per step: uniform U(0,1) or narrow U(0.4,0.6); N models: Dirichlet(1) or "
                                     "Dirichlet(36) (default narrow; dual on images or N models: uniform)",
                                     group=LEARNED, choices=LAMBDA_DISTRIBUTIONS)
    soft_targets: float | None = option(None, "share of the training target that is the endpoints' own prediction, "
                                        "mixed by the step's λ weights, instead of the next token (or label): 0 .. 1 "
                                        f"(default 1 on --train-data {SELF_DATA}, else 0; costs one forward per model "
                                        "per step)", group=LEARNED, low=0, high=1, metavar="S")
    start: str = option("wm", "where two models' learning starts: wm (weight matching) or am (activation matching on "
                        "--am-batches batches spread over the training data)", group=LEARNED, choices=("wm", "am"))
    train_data: str | None = option(None, "training data for lm/dual, same forms as --data, or a token file FILE.npy "
                                    f"(`hf-rebasin tokenize`, read memory-mapped), or {SELF_DATA}: sampled from the "
                                    f"models, 1/{SELF_SAMPLE_SHARE} of --steps x --learn-batch-size windows + the "
                                    "--holdout ones (default: --match-data, else for language models "
                                    f"{SELF_DATA}, for image models --data split in halves)", group=LEARNED)
    allow_train_on_eval: bool = option(False, "accept training data that shares examples with the evaluation data "
                                       "(refused otherwise: the barrier would be in-sample)", group=LEARNED)
    max_train_tokens: int | None = option(None, "cap on training tokens (LMs; default all; with "
                                             f"{SELF_DATA}: tokens to sample, up to --steps x --learn-batch-size "
                                             "windows + the --holdout ones)", group=LEARNED, low=1)
    max_train_examples: int | None = option(None, "cap on training images (default all)", group=LEARNED, low=1)
    eval_every: int = option(50, "steps between held-out midpoint-barrier estimates shown in the bar (0: off)",
                             group=LEARNED, low=0)
    eval_subset: int = option(32, "held-out examples (windows/images) for that estimate", group=LEARNED, low=0)
    holdout: int | None = option(None, "training examples kept out of the optimisation (text: windows of whole "
                                 "documents none of which is trained on; images and `self` samples: spread evenly "
                                 "over --train-data): at the start, every --eval-every steps and at the end the "
                                 "midpoint loss on them is measured and the best parameters are returned (0: the last "
                                 f"step's; default min({DEFAULT_HOLDOUT}, an eighth of the training examples))",
                                 group=LEARNED, low=0)
    checkpoint_every: int = option(0, "also save a checkpoint every K steps, all kept (0: none)", group=LEARNED, low=0)
    checkpoint_minutes: float = option(10.0, "save a checkpoint every M minutes of training, the newest one kept (0: "
                                       "none); Ctrl-C, SIGTERM and SIGHUP save one too", group=LEARNED, low=0)
    checkpoint_dir: str = option("runs/learned", "checkpoint folder", group=LEARNED)
    resume: str | None = option(None, "resume from a checkpoint file (or the newest one in a folder)", group=LEARNED)
    learn_seed: int = option(0, f"seed of the data order, λ draws and {SELF_DATA} samples", group=LEARNED, low=0)
    learn_precision: str = option("auto", "bf16: endpoints held in bf16, their transforms and the forward under "
                                  "bf16 autocast, symmetry parameters and optimiser state in fp32; auto = bf16 on "
                                  "CUDA, fp32 on CPU",
                                  group=LEARNED, choices=("auto", "bf16", "fp32"))

    gradient_checkpointing: bool = option(False, "recompute each layer's transformed weights and activations in the "
                                          "backward instead of keeping them (less memory, about one more forward "
                                          "per step); runs the loss layer by layer", group=LEARNED)
    fsdp: bool = option(False, "shard the frozen endpoints over the processes of an `accelerate launch` run (torch "
                        "FSDP2 fully_shard: each process stores 1/N of them and gathers a layer just before it runs); "
                        "the symmetry parameters stay whole on every process", group=LEARNED)
    max_memory: str | None = option(None, "device memory learned matching may plan for (e.g. 24GiB, 40GB; default "
                                    "the GPU's free memory; on the CPU no plan is made without it): the micro-batch, "
                                    "accumulation and checkpointing are chosen to fit, --learn-batch-size unchanged",
                                    group=LEARNED, metavar="SIZE")

    refine_steps: int = option(0, "merge: after alignment, train every weight of the merged model for N steps to "
                               "predict the endpoints' ensemble (the average of their next-token distributions) on "
                               f"the learned methods' data (--train-data, default {SELF_DATA}); 0 leaves the merged "
                               "model as it is", group=REFINE, low=0, high=10_000_000, metavar="N")
    refine_lr: float = option(1e-4, "AdamW learning rate of the refinement (the weights themselves; warmup and "
                              "cosine decay as for learned matching)", group=REFINE, above=0.0, high=1.0)

    # --- derived values ------------------------------------------------------------------------------
    def lambda_points(self) -> int:
        return DEFAULT_LAMBDAS if self.lambdas is None else self.lambdas

    def merge_alpha(self) -> float:
        return DEFAULT_ALPHA if self.alpha is None else self.alpha

    def resolution(self, n_models: int) -> int:
        return self.simplex_resolution or default_resolution(n_models)

    def learned_lambda_dist(self, n_models: int, task: str) -> str:
        return self.lambda_dist or default_lambda_dist(self.method, n_models, task)

    def soft_target_share(self, task: str) -> float:
        """--soft-targets, default 1 when a language model trains on self-sampled text (BENCHMARKS.md, "Soft
        targets"), else 0."""
        if self.soft_targets is not None:
            return self.soft_targets
        return 1.0 if self.self_sampled(task) else 0.0

    def warmup_steps(self) -> int:
        return max(1, self.steps // 10) if self.warmup is None else self.warmup

    def resolved_device(self) -> str:
        return resolve_device(self.device)

    def memory_bytes(self) -> int | None:
        """--max-memory in bytes (None: not given)."""
        from .export.io import parse_size
        return None if self.max_memory is None else parse_size(self.max_memory)

    def export_dtype(self):
        """The torch dtype of the export, or None for the sources' own."""
        import torch
        return None if self.dtype == "auto" else getattr(torch, self.dtype)

    def shard_bytes(self) -> int:
        from .export.io import parse_size
        return parse_size(self.max_shard_size)

    # --- checks --------------------------------------------------------------------------------------
    def self_sampled(self, task: str | None = None) -> bool:
        """Whether the method's matching data (learned methods: their training data) is sampled from the models of
        `task` (None: not known yet, taken to be language models)."""
        from .match import METHODS
        method = METHODS.get(self.method)
        if method is None or not method.needs_data or task not in (None, "causal-lm"):
            return False
        return (self.train_data or self.match_data or DEFAULT_LEARNED_DATA if method.learned
                else self.match_data) == SELF_DATA

    def refine_sampled(self, task: str | None = None) -> bool:
        """Whether --refine-steps trains on `self` samples (--train-data self, or a language model without
        --train-data)."""
        return self.refine_steps > 0 and task in (None, "causal-lm") and (self.train_data or SELF_DATA) == SELF_DATA

    def self_by_default(self, task: str | None = None) -> bool:
        """Whether `self` comes from DEFAULT_LEARNED_DATA rather than a flag."""
        return self.self_sampled(task) and not (self.train_data or self.match_data)

    def uses_rounds(self) -> bool:
        """Whether the method runs weight matching (wm, wm-perm, and lm/dual from its solution)."""
        return self.method not in ("raw", "am", "am-perm") and self.start == "wm"

    def refused_as_ignored(self, export: bool = True, task: str | None = None) -> list[str]:
        """A problem for every option that the run would ignore (but those HARMLESS_WHEN_IGNORED), by its flag."""
        flags = {f.name: flag_of(f) for f in fields_of(MergeOptions)}
        return [f"{flags[name]} {why}: drop it" for name, why in self.ignored(export, task).items()
                if name not in HARMLESS_WHEN_IGNORED]

    def ignored(self, export: bool = True, task: str | None = None) -> dict[str, str]:
        """{field: why} for every option set to other than its default that the method (or, export=False, a
        barrier, which writes no checkpoint) would ignore."""
        from .match import METHODS
        method = METHODS.get(self.method)
        if method is None:
            return {}
        why = {}
        refining = self.refine_steps > 0 and export
        if not method.learned:
            learned = ", ".join(name for name, m in METHODS.items() if m.learned)
            why.update({f.name: f"is for the learned methods ({learned}); --method {self.method} trains nothing"
                        for f in fields_of(MergeOptions) if f.metadata.get("group") == LEARNED
                        and not (refining and f.name in REFINE_USES)})
        if self.refine_steps == 0:
            why["refine_lr"] = "is for --refine-steps, and it is 0"
        elif not export:
            why["refine_steps"] = "trains the merged checkpoint, and barrier writes none (merge does)"
            why["refine_lr"] = "is for --refine-steps, which barrier does not run (merge does)"
        if not method.needs_data:
            why["match_data"] = f"is for the methods that match on data (am, lm, dual), not --method {self.method}"
            why["allow_overlap"] = f"is for the methods that fit on data (am, lm, dual), not --method {self.method}"
        if self.method not in ("am", "am-perm") and not (method.learned and self.start == "am"):
            why["am_batches"] = f"is for --method am / am-perm and --start am, not --method {self.method}"
        if self.self_sampled(task) or (refining and self.refine_sampled(task)):
            why.pop("learn_seed", None)  # it seeds the samples
        else:
            why.update(dict.fromkeys(("self_temperature", "self_top_p", "self_samples_dir"),
                                     f"is for --train-data / --match-data {SELF_DATA}, and this run samples nothing"))
        if method.learned and self.train_data is not None:
            why["match_data"] = f"is what --method {self.method} trains on without --train-data, and it is given"
        if self.method == "raw":
            why["no_raw_reference"] = "skips the plain average's reference barrier, and --method raw is that average"
        if not self.uses_rounds():
            why["rounds"] = f"caps the rounds of weight matching, which --method {self.method} does not run"
        if not export:
            why.update(dtype="sets the merged checkpoint's dtype, and barrier writes no checkpoint (merge does)",
                       max_shard_size="sets the merged checkpoint's shards, and barrier writes no checkpoint (merge "
                                      "does)")
        defaults = MergeOptions()
        return {name: reason for name, reason in why.items() if getattr(self, name) != getattr(defaults, name)}

    def check(self, n_models: int = 2, num_processes: int | None = None, export: bool = True,
              refuse_ignored: bool = True) -> None:
        """Raise OptionError naming every bad value (by its flag) and every combination that cannot work.
        num_processes: of this run (default: WORLD_SIZE, which `accelerate launch` and torchrun set, else 1);
        export: whether a checkpoint is written (merge) or not (barrier); refuse_ignored: whether an option the run
        would ignore is refused (a recipe leaves such options out of its merge command instead)."""
        if num_processes is None:
            import os
            num_processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
        from .match import METHODS
        problems = range_problems(self)
        method = METHODS.get(self.method)
        if method is None:
            problems.append(f"unknown --method {self.method!r}; choose one of {', '.join(METHODS)}")
        if n_models < 2:
            problems.append(f"got {n_models} model; a merge needs at least two (A B ...)")
        elif n_models > 2:
            if method is not None and not method.n_way:
                n_way = ", ".join(name for name, m in METHODS.items() if m.n_way)
                problems.append(f"--method {self.method} is not available for {n_models} models; use one of {n_way}")
            for name in ("alpha", "lambdas", "start"):
                if getattr(self, name) not in (None, "wm"):
                    problems.append(f"--{name} is for two models; {n_models} models are merged at their centroid "
                                    "and evaluated on the simplex lattice (--simplex-resolution)")
            points = lattice_size(n_models, self.resolution(n_models))
            if points > MAX_LATTICE_POINTS:
                problems.append(f"--simplex-resolution {self.resolution(n_models)} with {n_models} models gives "
                                f"{points:,} lattice points (model evaluations); the limit is {MAX_LATTICE_POINTS}: "
                                "lower "
                                "--simplex-resolution")
        elif self.simplex_resolution is not None:
            problems.append("--simplex-resolution is for three or more models; two models use --lambdas")
        from .sources.protocols import check_protocol
        problems += check_protocol(self)
        if self.seq_len is not None and self.max_eval_tokens < self.seq_len:
            problems.append(f"--max-eval-tokens {self.max_eval_tokens} is smaller than --seq-len {self.seq_len}: "
                            "no window fits")
        if self.seq_len is not None and self.max_train_tokens is not None and self.max_train_tokens < self.seq_len:
            problems.append(f"--max-train-tokens {self.max_train_tokens} is smaller than --seq-len {self.seq_len}")
        if self.warmup is not None and self.warmup >= self.steps:
            problems.append(f"--warmup must be in [0, --steps), got {self.warmup} with --steps {self.steps}")
        if self.grad_accum >= 1 and self.learn_batch_size % (self.grad_accum * num_processes):  # 0: a range problem
            problems.append(f"--learn-batch-size {self.learn_batch_size} is not divisible by --grad-accum "
                            f"({self.grad_accum}) × processes ({num_processes}); every micro-batch must have the "
                            "same size")
        if self.fsdp and num_processes == 1:
            problems.append("--fsdp shards the endpoints over the processes of `accelerate launch --num_processes N`, "
                            "and this run has one process: launch it with accelerate, or drop --fsdp "
                            "(--gradient-checkpointing saves memory in one process)")
        if self.refine_steps and (self.fsdp or self.gradient_checkpointing):
            problems.append(f"--refine-steps trains the merged model whole in every process: "
                            f"{'--fsdp' if self.fsdp else '--gradient-checkpointing'} is not available for it yet; "
                            "drop it (or lower --learn-batch-size / raise --grad-accum)")
        problems += self.refused_as_ignored(export) if refuse_ignored else []
        problems += device_problems(self.device, "--device")
        if num_processes > 1 and self.device.startswith("cuda:"):
            problems.append(f"--device {self.device} names one GPU, and under `accelerate launch` every process "
                            "trains on its own (cuda:LOCAL_RANK): use --device cuda (or auto), and pick the GPUs "
                            "with CUDA_VISIBLE_DEVICES or accelerate's --gpu_ids")
        try:
            self.shard_bytes()
        except UserError as error:
            problems.append(f"--max-shard-size: {error}")
        try:
            self.memory_bytes()
        except UserError as error:
            problems.append(f"--max-memory: {error}")
        if problems:
            raise OptionError("; ".join(problems))


def default_resolution(n_models: int) -> int:
    """6 for three models, else N (both put the centroid on the lattice) while the lattice stays small."""
    if n_models == 3:
        return 6
    r = n_models
    while r > 1 and lattice_size(n_models, r) > MAX_LATTICE_POINTS:
        r -= 1
    return r


def lattice_size(n_models: int, resolution: int) -> int:
    """Points of the simplex lattice with step 1/resolution: C(r + N - 1, N - 1)."""
    return comb(resolution + n_models - 1, n_models - 1)


# --- eval and push ------------------------------------------------------------------------------------

@dataclass
class EvalOptions:
    """What `eval` takes besides the merge folder."""

    tasks: str = option("piqa,sciq,arc_easy", "comma-separated lm-eval task names")
    endpoints: bool = option(False, "also evaluate the source models listed in barrier.json (columns A, B, ...)")
    limit: int | None = option(None, "at most N examples per task (for quick checks)", low=1)
    batch_size: str = option("8", "batch size, or 'auto'")
    device: str = option("auto", "where to run the model: auto (a CUDA GPU when present), cpu, cuda or cuda:N")
    include_path: str | None = option(None, "folder of extra lm-eval task YAMLs (e.g. local copies of tasks for "
                                      "offline use)", metavar="PATH")

    def check(self) -> None:
        problems = range_problems(self) + device_problems(self.device, "--device")
        if not (self.batch_size == "auto" or self.batch_size.startswith("auto:") or
                (self.batch_size.isdigit() and int(self.batch_size) > 0)):
            problems.append(f"--batch-size {self.batch_size!r} must be a positive integer or 'auto'")
        if problems:
            raise OptionError("; ".join(problems))


@dataclass
class PushOptions:
    """What `push` takes besides the folder and the repo id."""

    private: bool = option(False, "create the repository as private")
    revision: str | None = option(None, "branch to upload to (created from main if missing)")
    commit_message: str | None = option(None, "message of the upload commit")
    exist_ok: bool = option(False, "upload into the repository if it already exists (otherwise that is an error)")

    def check(self) -> None:
        problems = range_problems(self)
        if problems:
            raise OptionError("; ".join(problems))


@dataclass
class TokenizeOptions:
    """What `tokenize` takes besides DATA, --model and --out."""

    text_field: str = option("text", "text field of .jsonl / datasets rows")
    split: str | None = option(None, "split of a datasets spec without one (default: train for local loaders, test "
                               "for Hub datasets, as for --data)")
    max_tokens: int | None = option(None, "stop after this many tokens (default: all)", low=1)
    force: bool = option(False, "replace an existing --out")

    def check(self) -> None:
        problems = range_problems(self)
        if problems:
            raise OptionError("; ".join(problems))


API_KEYWORDS = {"--out": "out", "--force": "force=True", "--json": "json_path", "--push-to-hub": "push_to_hub",
                "--private": "private=True", "--model": "model"}


def python_terms(message: str) -> str:
    """A message of the command line's with every flag written as the keyword of the Python API that sets it
    (`--seq-len` as `seq_len`, `--force` as `force=True`)."""
    keywords = dict(API_KEYWORDS)
    for cls in (MergeOptions, TokenizeOptions):
        for f in fields_of(cls):
            keywords[flag_of(f)] = f"{f.name}=True" if value_type(cls, f) is bool else f.name
    return re.sub(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w-])", lambda m: keywords.get(m.group(0), m.group(0)), message)
