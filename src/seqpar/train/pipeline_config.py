"""The settings of pipeline parallel in ``seqpar train`` (--pp, --pp-schedule, --pp-microbatches) and their checks.

Note [pipeline in seqpar train]
    With ``--pp N`` the world is pp x dp x sp x tp (the "pp" axis outermost, ``seqpar.make_mesh(pp_size=)``).
    The prepared model is split by ``seqpar.apply_pipeline_parallel`` (one stage per pp rank; two with
    "interleaved"), and each of the step's ``--grad-accum`` batches is one pipeline ``step`` cut into
    ``--pp-microbatches`` pieces, its loss normalised by the valid tokens of the whole optimizer step over
    dp x sp; then ``reduce_gradients`` and the pipeline's ``clip_grad_norm_`` (Note [pipeline loss]).
    The loss a ``step`` returns is already summed over every rank; the train loop sums shares over the
    dp x sp group, so rank 0 of that group gives it and the others 0. The pass-key answer loss needs
    logits that only the last stage sees: it is not reported under --pp. Checkpoints hold each parameter
    (and its AdamW state) once, under its name in the unsplit model, written by the rank whose stage holds
    it, so a run at any pp / dp / sp resumes from it. The evaluation first broadcasts every parameter over
    pp from the rank whose stage holds it into each rank's unsplit model (which the stages were cut from),
    then evaluates that model with the sequence split over sp as without --pp. Only --dp-mode replicate,
    fp32 and untied embeddings (``tie_word_embeddings`` false) are taken with --pp so far.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def stages_per_rank(config: object) -> int:
    """Pipeline stages each pp rank runs: 2 for the interleaved schedule, else 1."""
    return 2 if config.pp_schedule == "interleaved" else 1


def microbatches(config: object) -> int:
    """The pipeline's micro-batches per ``step``: --pp-microbatches, default --pp."""
    return config.pp_microbatches or config.pp


def pipeline_problems(config: object) -> list[str]:
    """What is wrong with the pipeline settings of a ``TrainConfig`` (empty when they can work).

    Args:
        config: the run's settings.

    Returns:
        One line per problem (the layer count is checked where the model is known: ``seqpar.train.launch``).
    """
    problems = []
    if config.pp_schedule not in SCHEDULES:
        problems.append(f"--pp-schedule must be gpipe, 1f1b or interleaved, not {config.pp_schedule!r}")
    if config.pp < 2:
        return problems
    pieces = microbatches(config)
    rows = config.batch_size // max(config.grad_accum, 1)
    if pieces < config.pp:
        problems.append(
            f"--pp-microbatches {pieces} is fewer than --pp {config.pp}: every stage needs a micro-batch in flight"
        )
    elif rows % pieces:
        problems.append(
            f"--pp-microbatches {pieces} must divide the rows of each accumulated batch "
            f"(--batch-size {config.batch_size} / --grad-accum {config.grad_accum} = {rows})"
        )
    elif config.pp_schedule == "interleaved" and pieces > config.pp and pieces % config.pp:
        problems.append(f"--pp-schedule interleaved needs --pp-microbatches a multiple of --pp {config.pp}")
    if config.dp_mode != "replicate" or config.offload_optimizer:
        problems.append("--pp needs --dp-mode replicate (no ddp, fsdp or --offload-optimizer with pipeline stages)")
    if config.precision != "fp32":
        problems.append("--pp runs in fp32 only so far (the stages send float32 activations); drop --precision bf16")
    return problems


def pipeline_model_check(config: object, model_config: object) -> None:
    """Refuse --pp settings that the model cannot take (run in every launching process, before ranks train).

    Args:
        config: the run's settings.
        model_config: the transformers config of the run's model.

    Raises:
        SeqparInputError: fewer decoder layers than pipeline stages, or tied input and output embeddings.
    """
    from seqpar.errors import SeqparInputError

    if config.pp < 2:
        return
    stages = config.pp * stages_per_rank(config)
    layers = getattr(model_config, "num_hidden_layers", 0)
    if layers < stages:
        per_rank = " (interleaved: 2 per rank)" if stages_per_rank(config) > 1 else ""
        raise SeqparInputError(
            f"--pp {config.pp} needs {stages} pipeline stages{per_rank} of at least one decoder layer each, "
            f"but the model has {layers} layers: lower --pp or use a model with more layers (--layers)"
        )
    if getattr(model_config, "tie_word_embeddings", False):
        raise SeqparInputError(
            "--pp in seqpar train does not take tied input and output embeddings yet (tie_word_embeddings); "
            "use seqpar.apply_pipeline_parallel directly, or a model with untied embeddings"
        )
