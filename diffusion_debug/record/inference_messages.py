"""The one sentence of each inference anomaly, built from the anomaly's own place and details:
one builder a kind, given to ``register_kind`` as its ``message`` in ``record/kinds.py``. Pure.
(Where the advice depends on the component's role, the check says so in ``details["vae_role"]``.)

>>> from diffusion_debug.record import make_anomaly
>>> print(make_anomaly("nonfinite", component="vae", module="decoder.conv_out", step=3,
...       details={"localized_by": "full probes", "vae_role": False}).message)
vae.decoder.conv_out produced NaN/Inf from finite inputs (check its dtype, inputs and weights; try float32 or
bfloat16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .advice import autocast_advice, names_autocast, near_max_advice, overflow_advice, upcast_of, vae_advice
from .messages import counted, follows, memory_source

if TYPE_CHECKING:
    from .anomaly import Anomaly


def _after_origin(anomaly: Anomaly, text: str) -> str:
    """``text`` pointing at the run's first NaN/Inf (``details["origin"]``, set when a later error
    became its consequence), else as it is."""
    origin = anomaly.details.get("origin")
    if origin is None or anomaly.details.get("passed_on"):
        return text
    return text.rstrip(".") + follows("the first NaN/Inf", origin) + "."


# -- NaN / Inf --------------------------------------------------------------------------------------
def nonfinite(anomaly: Anomaly) -> str:
    """Inference's ``nonfinite``: the module that made it, what passed it on, or where it came
    from when no watched module made it (``details["localized_by"]`` says which)."""
    return _after_origin(anomaly, _nonfinite(anomaly))


def _nonfinite(anomaly: Anomaly) -> str:
    d, component = anomaly.details, anomaly.component
    how = d["localized_by"]
    if how == "pipeline inputs":
        first, listed = d["inputs"][0], ", ".join(f"{n}=" for n in d["inputs"])
        if d.get("near_max") is not None:  # finite, but near the max: what the pipeline did with them overflowed
            return (
                f"The pipeline input {listed} was at {d['near_max']:.0%} of its dtype's maximum, and what was "
                f"computed from it overflowed to NaN/Inf (first seen by {d['seen_in']}); pass values well inside "
                f"the dtype's range (check how {first} was made and scaled), or run the pipeline in bfloat16 or "
                "float32."
            )
        if d.get("raised"):  # the pipeline's own code raised before any component was given it
            return (
                f"The pipeline input {listed} held NaN/Inf, and {d['seen_in']} raised {d['raised']} before any "
                f"component received it; pass finite values (check how {first} was made, its dtype and any "
                "division or log before it)."
            )
        return (
            f"The pipeline input {listed} held NaN/Inf (first seen by {d['seen_in']}); pass finite values "
            f"(check how {first} was made, its dtype and any division or log before it)."
        )
    if how == "made in an earlier run":  # a watched component's NaN/Inf, given back by the user
        where = f"{component}.{anomaly.module}" if anomaly.module else component
        listed, run = ", ".join(f"{n}=" for n in d["passed_as"]), d.get("run")
        method = "pipe(...)" if d["made_in"] == "__call__" else f"pipe.{d['made_in']}"
        autocast = _fp16_autocast(d)  # (the maker's, as its error advised)
        fix = f"fix {where}, not the input; {autocast_advice(where, autocast)}." if autocast else None
        return (
            f"{where} made NaN/Inf in {f'run {run}' if run else 'an earlier run'} ({method}), and it "
            f"was passed back to a later call as {listed} (first seen by {d['seen_in']}); "
        ) + (fix or f"fix {where} (check its dtype, inputs and weights; try float32 or bfloat16), not the input.")
    if how == "call arguments":
        shown = ", ".join(d["arguments"]) if d["arguments"] else "its inputs"
        made = f"{d['seen_in']} received non-finite {shown} that no watched component and no pipeline input made: "
        if d.get("between_passes") and d.get("free_init"):  # FreeInit's re-noising between two passes
            before, after = d["between_passes"]
            return made + (
                f"the pipeline's own code between FreeInit passes {before} and {after} produced it (FreeInit "
                "re-noises the latents there: its frequency filter, a dtype cast); check the FreeInit options "
                "(enable_free_init) and the dtypes of the pipeline's components."
            )
        if d.get("between_passes"):
            before, after = d["between_passes"]
            return made + (
                f"the pipeline's own code between its runs {before} and {after} in one call produced it (a division, "
                "a log, a dtype cast); check the pipeline's options and the dtypes of its components."
            )
        return made + (
            "the pipeline's own code between calls produced it (a division, a log, a dtype cast); check the "
            "pipeline's options and the dtypes of its components."
        )
    if how == "replaced during the call":
        replaced = " and ".join(d["replaced"])
        return (
            f"{d['seen_in']} received NaN/Inf after {replaced} were replaced during the call at step {anomaly.step}: "
            "their steps ran unwatched (nothing the debugger hooks ran in the loop after it), so the module that "
            "made it is not known; the pipeline's next call with them is watched."
        )
    if how == "its own state":
        shown = ", ".join(d["arguments"])
        return (
            f"{component} got NaN/Inf back through its own {shown}, which its earlier calls fill and read back: "
            f"one of its modules made it in an earlier call of this {d['phase']} whose output was finite or not read "
            "(a cache step's); "
            f"check {component}'s dtype and weights."
        )
    if how == "step-end callback":
        made, seen = anomaly.step, f"{d['seen_at_step']}" + (" of the next pass" if d.get("seen_in_next_pass") else "")
        return (
            f"The {anomaly.module} passed to the pipeline put NaN/Inf into the loop at the end of step {made}: "
            f"scheduler.step returned finite latents, and {d['seen_in']} received non-finite values at step {seen}; "
            "check what the callback returns (its callback_kwargs)."
        )
    if how == "scheduler.step arguments" and d["phase"] == "guidance":
        return (
            f"{d['denoiser']}'s output was finite but the model output passed to scheduler.step was not: the "
            "guidance arithmetic between them made it (check guidance_scale, guidance_rescale and the dtype)."
        )
    if how == "scheduler.step arguments":
        made = "from finite inputs" if d["sample_finite"] else "its input latents were already non-finite"
        return (
            f"{d['scheduler']}.step returned non-finite latents {made} (the model output was finite); check the "
            "scheduler's config (prediction_type, sigmas, final_sigmas_type) and the latents' dtype."
        )
    if not component:  # a step's model output, in a pipeline with no component known as its denoiser
        return (
            "The model output passed to scheduler.step held NaN/Inf, and no watched component is known as the "
            "denoiser that made it; check the model the pipeline calls in its loop (its dtype, inputs and weights)."
        )
    if d.get("overflowed_in"):  # a module's near-max values, on which the next one's arithmetic overflowed
        where = f"{component}.{anomaly.module}"
        return (
            f"{where} made values at {d['near_max']:.0%} of the {d['dtype']} maximum (|x|={d['absmax']:.4g}), and "
            f"{component}.{d['overflowed_in']}, given them, produced NaN/Inf (its arithmetic overflowed on them: a "
            f"norm's variance, a matmul); {near_max_advice(where, d)}."
        )
    if d.get("near_max_from"):  # the consequence of the above, at the module that overflowed
        made = f"{component}.{d['near_max_from']}"
        return (
            f"{component}.{anomaly.module} produced NaN/Inf from finite inputs at {d['input_near_max']:.0%} of "
            f"the {d['dtype']} maximum (its arithmetic overflowed on them)"
            + follows("the near-max values made", made)
            + "."
        )
    if d.get("passed_on"):
        origin = d.get("origin")
        earlier = f"the first NaN/Inf at {origin}" if origin else "the earlier anomaly (the first NaN/Inf producer)"
        return f"{component} received non-finite input and passed it on; fix {earlier} rather than {component}."
    where = f"{component}.{anomaly.module}" if anomaly.module else component
    autocast = _fp16_autocast(d)
    if d.get("unread_output"):  # an encoder's last layers, which the pipeline skipped (SDXL's hidden_states[-2])
        return (
            f"{where} produced NaN/Inf from finite inputs in hidden states the pipeline did not pass on (its "
            "denoising loop was given finite values), so the result is not affected; an fp16 overflow in a "
            "final layer often does this"
        ) + (
            f"; {autocast_advice(where, autocast)}."
            if autocast
            else " (check its dtype and weights; try float32 or bfloat16)."
        )
    if d.get("unwatched_call"):  # a component replaced during the call: its first call ran before any hook
        return (
            f"{where}'s output held NaN/Inf in its first call after it was replaced during the pipeline's call "
            f"(step {anomaly.step}): that call ran before the debugger hooked it, so whether its inputs were finite "
            f"is not known and no module inside it is named; its later calls are watched (check {component}'s "
            "dtype and weights)."
        )
    advice = "check its dtype, inputs and weights; try float32 or bfloat16"
    if autocast:
        advice = autocast_advice(where, autocast)
    if d.get("clipped_in"):  # a block clipped it to the dtype's max (Flux's fp16 blocks): the output stayed finite
        return (
            f"{where} produced Inf from finite inputs ({d['dtype']} overflow); {component}.{d['clipped_in']} "
            f"clipped it to {_clipped_to(d)}, so the output stayed finite but carries that clipped value, not the "
            "one computed" + (f"; {advice}." if autocast else f" ({advice}).")
        )
    if d.get("vae_role") and not autocast:  # (a VAE under another dtype's autocast: its advice says it, after "; ")
        advice = vae_advice(
            component, d.get("sd_vae", False), d.get("vae_dtype"), d.get("vae_autocast"), **upcast_of(d)
        )
        autocast = names_autocast(d.get("vae_dtype"), d.get("vae_autocast"))
    own = "its own forward" if not anomaly.module else "its forward"
    if d.get("before") and d.get("after"):  # made by its own code between two of its modules (decide.between_modules)
        return (
            f"{where} produced NaN/Inf from finite inputs in {own}, between its modules: the output of "
            f"{component}.{d['after']} was finite, the input of {component}.{d['before']} was not (an operation "
            f"there, such as a residual added to the stream, overflowed; {advice})."
        )
    if d.get("before"):  # before its first module ran
        return (
            f"{where} produced NaN/Inf from finite inputs in {own}, before its modules: its inputs were finite, "
            f"the input of {component}.{d['before']}, the first module to run in it, was not ({advice})."
        )
    if d.get("after"):  # where no module of it took it
        return (
            f"{where} produced NaN/Inf from finite inputs in {own}, after its modules: every module in it was "
            f"given and returned finite values (the last to return: {component}.{d['after']}), its output was "
            f"not ({advice})."
        )
    return f"{where} produced NaN/Inf from finite inputs" + (f"; {advice}." if autocast else f" ({advice}).")


def _fp16_autocast(details: dict[str, Any]) -> str | None:
    """The dtype of the weights of a module whose float16 output came from them (``weights_dtype``: float32 weights
    under float16 autocast, :func:`~diffusion_debug.diffusion.checks.nonfinite`), None otherwise."""
    return details.get("weights_dtype") if details.get("dtype") == "float16" else None


def _clipped_to(details: dict[str, Any]) -> str:
    """The value a block clipped an Inf to (``clipped_to``, its output's abs-max as read), said against its dtype's
    largest value: T5 clamps a float16 stream to ``finfo.max - 1000``, Flux's blocks to the max itself.

    >>> _clipped_to({"dtype": "float16", "dtype_max": 65504.0, "clipped_to": 64512.0})
    "64512, below float16's largest value (65504)"
    >>> _clipped_to({"dtype": "float16", "dtype_max": 65504.0, "clipped_to": 65504.0})
    "float16's largest value (65504)"
    """
    largest, value = details.get("dtype_max"), details.get("clipped_to")
    said = f"{details['dtype']}'s largest value" + (f" ({largest:.6g})" if largest else "")
    return f"{value:.6g}, below {said}" if value is not None and largest and value < largest else said


def overflow_risk(anomaly: Anomaly) -> str:
    d = anomaly.details
    if d.get("localized_by") == "pipeline inputs":  # the values the user passed (checks.input_overflow_risk)
        listed = ", ".join(f"{n}=" for n in d["inputs"])
        return (
            f"The pipeline input {listed} was at {d['dtype_max_fraction']:.0%} of its dtype's maximum as "
            f"{d['seen_in']} was given it (no module made these values); pass values well inside the dtype's "
            "range, or run the pipeline in bfloat16 or float32."
        )
    where = f"{anomaly.component}.{anomaly.module}" if anomaly.module else anomaly.component  # "": its output
    advice = overflow_advice(where, d)
    if d.get("before"):  # its own forward built them between two of its modules (decide.overflow_between)
        return (
            f"{where}'s own forward, between its modules, made values at {d['dtype_max_fraction']:.0%} of the "
            f"{d['dtype']} maximum (|x|={d['absmax']:.4g}): the output of {where}.{d['after']} was below "
            f"{d['threshold']:.0%}, the input of {where}.{d['before']} was not (an operation there, such as a "
            f"residual added to the stream, grew it); {advice}."
        )
    unread = (  # a compiled component's output (no probe inside it)
        f" {anomaly.component} is compiled: its inside is not read, so the module that made these values is not "
        + (
            "named, and an uncompiled replay of the call stayed below that (the compiled code computes otherwise: "
            "a hook it skips, a fused rounding);"
            if d.get("eager_replay")
            else "named (run it uncompiled once to name it);"
        )
        if d.get("compiled")
        else ""
    )
    return (
        f"{where} output reached {d['dtype_max_fraction']:.0%} of the {d['dtype']} "
        f"maximum (|x|={d['absmax']:.4g});{unread} {advice}."
    )


# -- latents and images -----------------------------------------------------------------------------
def latent_divergence(anomaly: Anomaly) -> str:
    text = _latent_divergence(anomaly)
    if "origin" in anomaly.details:  # its own guess at the cause gives way to the origin
        text = text.split(";")[0]
    return _after_origin(anomaly, text)


def _latent_divergence(anomaly: Anomaly) -> str:

    d = anomaly.details
    if "nan" in d:
        cause = (
            "the model output was finite, so scheduler.step made them (check its config and dtype)"
            if anomaly.severity == "error"
            else "the denoiser output was already non-finite (see the nonfinite anomaly)"
        )
        return f"Latents became non-finite ({d['nan'] + d['posinf'] + d['neginf']} values); {cause}."
    if "std" in d:
        return (
            f"Latent std {d['std']:.3g} is {d['std'] / d['expected_std']:.1f}x what the noise level implies "
            f"({d['expected_std']:.3g}); check prediction_type, the scheduler and guidance_scale."
        )
    return (
        f"Latent norm grew {d['l2'] / d['previous_l2']:.1f}x in one step; check guidance_scale "
        "and the scheduler's prediction_type."
    )


def vae_saturation(anomaly: Anomaly) -> str:
    return (
        f"{anomaly.details['outside_fraction']:.1%} of decoded pixels lie outside [-1, 1] and will be clipped; check "
        "the latent scaling (vae.config.scaling_factor / shift_factor) and the VAE dtype."
    )


def prompt_truncated(anomaly: Anomaly) -> str:
    d = anomaly.details
    text = d["dropped_text"]
    shown = text if len(text) <= 80 else text[:77] + "..."
    return (
        f"{d['tokenizer']} keeps {d['max_length']} tokens, so {d['dropped_tokens']} token(s) of the "
        f'{d["prompt_role"]} were dropped ("{shown}"); shorten it, or use prompt embeddings built from chunks.'
    )


def constant_image(anomaly: Anomaly) -> str:
    """A flat image, advised by what its VAE computed in: its weights' dtype (``vae_dtype``; the decoded images',
    ``decoded_dtype``, where the weights' is not known), or the autocast it ran under (``vae_autocast``,
    :func:`~.advice.names_autocast`). Only a float16 one is "often" an fp16 VAE's; a bfloat16 one is told its range
    is float32's, as a float32 one is told it ran in float32."""
    d = anomaly.details
    flat = f"{len(d['flat_images'])} decoded image(s) are a single flat colour"
    component, sd_vae, upcast = anomaly.component, d.get("sd_vae", False), upcast_of(d)
    dtype, autocast = d.get("vae_dtype") or d.get("decoded_dtype"), d.get("vae_autocast")
    if dtype in ("float32", "bfloat16") or names_autocast(dtype, autocast):  # no fp16 overflow, or not its dtype's
        check = "the latents' scaling factor, the latents reaching it (the step table) and its weights"
        ran = dict(subject=component, check=check, finite="the latents and weights")
        return f"{flat}; {vae_advice(component, sd_vae, dtype, autocast, **upcast, **ran)}."
    advice = vae_advice(component, sd_vae, dtype, autocast, **upcast)
    fp16 = "often a black image from an fp16 VAE: " if dtype in (None, "float16") else ""
    return f"{flat} ({fp16}{advice})."


def safety_blackout(anomaly: Anomaly) -> str:
    flagged = anomaly.details["flagged_images"]
    return (
        f"the safety checker flagged {len(flagged)} image(s) ({flagged}) as NSFW and replaced them with black "
        "images; the latents and the VAE output were not the cause."
    )


def nondeterministic(anomaly: Anomaly) -> str:
    d = anomaly.details
    if d.get("reason") == "global_rng":
        return (
            "the call drew random numbers from torch's global RNG although it was given generator=: the same "
            "generator gives another image at each call unless torch.manual_seed is set before it (something "
            "in the pipeline draws without the generator)."
        )
    step = d["first_step"]
    where = f"the latents first differ at step {step}" if step is not None else "the latents' statistics agree"
    difference = d["max_pixel_difference"]
    shown = difference if isinstance(difference, str) else f"{difference:g}"  # "inf" read back from JSON
    return f"the same call with the same seed gave a different image (max pixel difference {shown}); {where}."


def memory_growth_across_calls(anomaly: Anomaly) -> str:
    """``memory_growth`` of a pipeline called again and again (the training debugger's is per step)."""
    d = anomaly.details
    what = memory_source(d["source"])
    return (
        f"{what} grew by {d['growth_mb']:.0f} MB over {d['calls']} pipeline calls ({d['per_call_mb']:.1f} MB a "
        f"call), from call {d['first_call']} on: something keeps what each call made (outputs appended to a list, "
        "a cache, state kept by a callback)."
    )


# -- set-up -----------------------------------------------------------------------------------------
def scheduler_config(anomaly: Anomaly) -> str:
    d = anomaly.details
    name, rule = d["scheduler"], d["rule"]
    if rule == "zero_snr_epsilon":
        return (
            f"{name} has rescale_betas_zero_snr=True with prediction_type='epsilon', which cannot predict noise at "
            "zero SNR; use a v-prediction model with prediction_type='v_prediction' or turn the rescale off."
        )
    if rule == "zero_snr_spacing":
        return (
            f"{name} has rescale_betas_zero_snr=True with timestep_spacing={d['timestep_spacing']!r}, so sampling "
            "never starts from pure noise; set timestep_spacing='trailing'."
        )
    if rule == "steps_offset":  # fired only where the pipeline names the family it was trained as
        return (
            f"{name} has timestep_spacing='leading' with steps_offset=0, so the last step lands on t=0 "
            f"instead of t=1 as {d['family']} was trained; set steps_offset=1."
        )
    # few steps start low; from 10 on, a count that does not divide the schedule cuts its start (300: t=898)
    steps, train = d["num_inference_steps"], d["num_train_timesteps"]
    other = "use more steps" if steps < 10 else f"a step count that divides {train}"
    return (
        f"With {counted(steps, 'step')} and timestep_spacing='leading' the first step is "
        f"t={d['first_timestep']:g} of {train}, so sampling starts from a partly denoised level "
        f"and images look washed out; set timestep_spacing='trailing' or {other}."
    )


def compile_bypassed(anomaly: Anomaly) -> str:
    """A VAE compiled whole, whose compiled ``forward`` the pipeline never calls.

    >>> from diffusion_debug.record import make_anomaly
    >>> print(make_anomaly("compile_bypassed", component="vae",
    ...       details={"compiled": "wrapper", "method": "decode", "half": "decoder"}).message)
    vae is wrapped by torch.compile, which compiles its forward, but the pipeline calls vae.decode, which runs
    uncompiled: compile that method (pipe.vae.decode = torch.compile(pipe.vae.decode)) or vae.decoder
    (pipe.vae.decoder.compile()).
    """
    d, name = anomaly.details, anomaly.component
    how = "is wrapped by torch.compile" if d["compiled"] == "wrapper" else f"was compiled in place ({name}.compile())"
    method, half = d["method"], d["half"]
    return (
        f"{name} {how}, which compiles its forward, but the pipeline calls {name}.{method}, which runs uncompiled: "
        f"compile that method (pipe.{name}.{method} = torch.compile(pipe.{name}.{method})) or {name}.{half} "
        f"(pipe.{name}.{half}.compile())."
    )


def dtype_mismatch(anomaly: Anomaly) -> str:
    d: dict[str, Any] = anomaly.details
    if "vae_dtype" in d:
        return (
            "The SDXL VAE is float16 with force_upcast=False, and the stock SDXL VAE overflows in float16 (black or "
            f"NaN images); {vae_advice(anomaly.component, sd_vae=True, **upcast_of(d))}."
        )
    mixed = ", ".join(f"{k}={v}" for k, v in d["half_dtypes"].items())
    return (
        f"Components mix float16 and bfloat16 ({mixed}); values cast from bfloat16 to float16 can overflow, so load "
        "every component in one dtype."
    )
