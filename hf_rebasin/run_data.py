"""The data of a run: what each method is evaluated on (--data), what it fits on (--train-data, --match-data,
one half of --data, or `self` samples drawn from the models), and the overlap check between the two."""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

from .errors import OptionError
from .export.ownership import probe_folder
from .match import METHODS, MatchContext
from .match.alignment import DEFAULT_HOLDOUT
from .options import SELF_DATA, SELF_SAMPLE_SHARE, MergeOptions
from .sources.eval_data import EvalData, load_eval_data
from .sources.models import Loaded
from .sources.splits import shared_examples, split_in_halves


def eval_data(spec: str | None, template: Loaded, options: MergeOptions, flag: str = "--data") -> EvalData:
    if spec is None:
        raise OptionError("--data is required for image models (an ImageFolder, an .npz or a Hub dataset)")
    if options.protocol != "default" and flag == "--data":  # a paper's evaluation (sources/protocols.py)
        from .sources.protocols import load_protocol_data
        return load_protocol_data(options.protocol, spec, template, options.text_field)
    return load_eval_data(spec, template, seq_len=options.seq_len, max_tokens=options.max_eval_tokens,
                          max_examples=options.max_eval_examples, text_field=options.text_field, flag=flag)


def training_data(options: MergeOptions, template: Loaded, match_data: EvalData | None, data: EvalData,
                  data_spec: str, samples: EvalData | None = None) -> tuple[EvalData, EvalData, list[str]]:
    """(training data, evaluation data, notes) of a learned method: `samples` when it trains on sequences sampled
    from the models (`self`: asked for, or language models without --train-data and --match-data), else
    --train-data, else --match-data; --data itself (--train-data naming the --data set, or image models given
    --data alone) is split into disjoint halves (split_in_halves: text by document, never window by window), or
    trained on whole with --allow-train-on-eval.  Training data that shares examples with the evaluation data
    (compared by content) is refused unless --allow-train-on-eval."""
    notes = []
    who = "learned matching" if METHODS[options.method].learned else "the refinement (--refine-steps)"
    if samples is not None:
        train = samples
        if options.self_by_default(template.task) or not (options.train_data or options.match_data):
            notes.append(f"no --train-data: {who} trained on {samples.info['tokens']:,} predicted tokens of text "
                         f"sampled from the models themselves ({SELF_DATA}, the default for language models)")
    elif options.train_data and options.train_data != data_spec:
        train = load_eval_data(options.train_data, template, seq_len=options.seq_len,
                               max_tokens=options.max_train_tokens, max_examples=options.max_train_examples,
                               text_field=options.text_field, flag="--train-data")
    elif not options.train_data and match_data is not data:
        train = match_data
    elif options.allow_train_on_eval:
        train = data
    else:
        if len(data.inputs) < 4:
            raise OptionError(f"--method {options.method} training on --data splits it into training and evaluation "
                              f"halves, and {len(data.inputs)} examples are too few: pass another --train-data")
        train, data, how = split_in_halves(data, template, options.learn_seed)
        given = "--train-data is the --data set" if options.train_data else "no --train-data"
        notes.append(f"{given}: --data was split into disjoint halves ({how}); {who} trained "
                     f"on {len(train.inputs)} examples, the barrier is measured on the other {len(data.inputs)}")
    shared = shared_examples(train, data)
    if shared:
        where = "--train-data" if options.train_data else "--match-data" if match_data is not data else "--data"
        if not options.allow_train_on_eval:
            raise OptionError(f"{shared} of the {len(train.inputs)} training examples ({where}) are also in the "
                              f"evaluation data (--data), compared by content: the barrier would be in-sample. Pass "
                              f"a disjoint --train-data, the --data spec itself as --train-data to split it into "
                              f"halves, or --allow-train-on-eval to accept an in-sample barrier")
        notes.append(f"{who} trained on {shared} examples that are also evaluated (--allow-train-on-eval): "
                     "the reported barrier is partly in-sample")
    return train, data, notes


def matching_split(options: MergeOptions, template: Loaded, data: EvalData) -> tuple[EvalData, EvalData, list[str]]:
    """(matching data, evaluation data, notes) of activation matching given no other --match-data: --data split by
    document as the learned methods split it (split_in_halves), never matched on the windows it is evaluated on."""
    if len(data.inputs) < 4:
        raise OptionError(f"--method {options.method} without --match-data matches on one half of --data and is "
                          f"evaluated on the other, and {len(data.inputs)} examples are too few: pass --match-data")
    match, data, how = split_in_halves(data, template, options.learn_seed)
    return match, data, [f"no other --match-data: --data was split into disjoint halves ({how}); activation matching "
                         f"used {len(match.inputs)} examples, the barrier is measured on the other {len(data.inputs)}"]


def fitting_overlap(method, context: MatchContext, data: EvalData, options: MergeOptions,
                    refine: bool = False) -> tuple[dict | None, list]:
    """The n-gram overlap between what the method fits on (refine: what --refine-steps trains on) and the
    evaluation data (sources.overlap), refused above its limit before the matching starts unless --allow-overlap
    (or, for what trains, --allow-train-on-eval)."""
    from .sources.overlap import check_overlap
    trains = method.learned or refine
    fit = context.train_data if trains else context.match_data if method.needs_data else None
    if fit is None:
        return None, []
    sampled = options.refine_sampled(data.task) if refine else options.self_sampled(data.task)
    fitted_on = ("the self samples" if sampled else
                 "--train-data" if trains and options.train_data else
                 "--match-data" if options.match_data and not refine else "the other half of --data")
    return check_overlap(fit, data, method=options.method, fitted_on=fitted_on,
                         allow=options.allow_overlap or (trains and options.allow_train_on_eval),
                         vocab_size=getattr(context.template.config, "vocab_size", None))


def self_sample_windows(options: MergeOptions, seq_len: int) -> int:
    """How many windows `self` samples: lm/dual an eighth of the windows their steps draw (--max-train-tokens: up
    to all of them) and the held-out ones; activation matching its --am-batches batches of --batch-size."""
    learned = METHODS[options.method].learned
    if not learned and not options.refine_sampled():
        return options.am_batches * options.batch_size
    # --refine-steps draws from the same samples as learned matching (or alone, after any other method)
    drawn = max(options.steps if learned else 0, options.refine_steps) * options.learn_batch_size
    matching = options.am_batches * options.batch_size if options.self_sampled() and not learned else 0
    held = DEFAULT_HOLDOUT if options.holdout is None else options.holdout
    if options.max_train_tokens is None:
        return max(-(-drawn // SELF_SAMPLE_SHARE) + held, matching)
    return max(min(drawn + held, options.max_train_tokens // seq_len), matching)


def self_samples(loaded: list[Loaded], template: Loaded, options: MergeOptions, progress: bool,
                 timings: dict) -> EvalData:
    """`self` data: sequences sampled from every model (an equal share each), cached as a token file in
    --self-samples-dir; timings["sample_s"] is the time it took (about nothing when the file is reused)."""
    import torch

    from .sources.eval_data import check_seq_len, default_seq_len
    from .sources.self_samples import Sampling, chain_settings, sampled_data, start_token, weights_digest
    from .sources.token_files import vocabulary_digest
    start = time.perf_counter()
    seq_len = options.seq_len or default_seq_len(template)
    check_seq_len(seq_len, template)
    learned = METHODS[options.method].learned or options.refine_sampled(template.task)
    windows = self_sample_windows(options, seq_len)
    if windows < len(loaded):
        raise OptionError(f"{windows} sampled windows cannot give each of the {len(loaded)} models a share: raise "
                          "--max-train-tokens")
    by_default = options.self_by_default(template.task) or (options.refine_sampled() and not options.train_data)
    if by_default and progress:
        what = f"--method {options.method}" if METHODS[options.method].learned else "--refine-steps"
        print(f"hf-rebasin: no --train-data: {what} trains on {windows:,} windows of {seq_len} "
              f"tokens sampled from the models themselves (--train-data {SELF_DATA}); pass --train-data for text of "
              "your own",
              file=sys.stderr, flush=True)
    tokenizer = template.backend.tokenizer(template.folder)
    device = options.resolved_device()
    dtype = sampling_dtype(options, device)
    sampling = Sampling(models=tuple(weights_digest(m.files.files) for m in loaded),
                        vocabulary_digest=vocabulary_digest(tokenizer), windows=windows, seq_len=seq_len,
                        temperature=options.self_temperature, top_p=options.self_top_p, seed=options.learn_seed,
                        start_token=start_token(tokenizer), vocab_size=len(tokenizer), **chain_settings(),
                        precision="bf16" if dtype == torch.bfloat16 else "fp32")
    refining_only = not METHODS[options.method].learned and options.refine_sampled(template.task)
    flag = "--train-data" if (learned and options.train_data) or (refining_only and not options.match_data) \
        else "--match-data"
    first = nullcontext()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # accelerate launch: the main process samples, the others
        from accelerate import PartialState  # read its file after it
        first = PartialState(cpu=options.device == "cpu").main_process_first()  # as make_accelerator sets it
    with first:
        data = sampled_data(endpoint_loader(loaded, device, dtype), sampling, tokenizer,
                            options.self_samples_dir, device=device, progress=progress, flag=flag,
                            names=[m.source for m in loaded], memory_mapped=learned,
                            check_writable=lambda folder: probe_folder(folder, "--self-samples-dir"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the models sampled from are gone
    timings["sample_s"] = time.perf_counter() - start
    return data


def sampling_dtype(options: MergeOptions, device: str):
    """The dtype `self` samples in: the learning precision (--learn-precision; auto: bf16 on CUDA, fp32 on CPU)."""
    import torch

    from .match.learned import autocast_dtype
    return autocast_dtype(options, torch.device(device)) or torch.float32


def endpoint_loader(loaded: list[Loaded], device: str, dtype):
    """load(k): model k on `device` in `dtype` (None: as its loader gives it; loaded on the host, converted there,
    then moved: one model on the device at a time, as long as the caller drops the one before)."""
    def load(k: int):
        model = loaded[k].backend.load_model(loaded[k])
        return (model if dtype is None else model.to(dtype=dtype)).to(device)
    return load


# --- the lattice and the report -------------------------------------------------------------------
