import base64
import hashlib
import html
import io
import json
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from report_page import NAN_GRAD_STEP, PLANTED_MODULE, PLANTED_STEP, read_page

from diffusion_debug.record import KINDS, STABLE_KINDS, Anomaly, dumps, loads
from diffusion_debug.report import load_run, write_html
from diffusion_debug.report.guide import guide_markdown
from diffusion_debug.report.plots import HEATMAP_MAX_COLUMNS, build_plots
from diffusion_debug.report.plots_training import _bin_columns

# one worker under `pytest -n 2 --dist loadgroup`: the pages and runs of the module's and the session's
# fixtures are made once, not once on each worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("report_html")

PNG = "data:image/png;base64,"
GIF = "data:image/gif;base64,"


@pytest.fixture(scope="module")
def inference_page(inference_run_dir):
    return read_page(write_html(inference_run_dir).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def training_page(training_run_dir):
    return read_page(write_html(training_run_dir).read_text(encoding="utf-8"))


def _decode(src):
    assert src.startswith(PNG) or src.startswith(GIF), src[:60]
    image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1], validate=True)))
    image.load()
    return image


def _write_run(path, summary):
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text(dumps(summary), encoding="utf-8")
    return path


# -- inference ----------------------------------------------------------------------------


def test_planted_nonfinite_is_listed_with_module_and_step(inference_page):
    anomalies = inference_page.section_text["anomalies"]
    assert "kind-nonfinite" in inference_page.ids
    assert f"module {PLANTED_MODULE} · step {PLANTED_STEP}" in anomalies
    assert "nonfinite × 2 (1 error, 1 warning)" in anomalies
    assert "Most important: nonfinite at unet up_blocks.1.resnets.0.conv2, step 2" in anomalies
    # the guide text for the kind sits next to the group
    assert KINDS["nonfinite"].action in anomalies


def test_anomalies_come_before_plots_and_tables(inference_page):
    assert inference_page.section_order == ["anomalies", "plots", "steps", "components", "files"]


def test_inference_plots_are_embedded_pngs(inference_page):
    figures = inference_page.figure_ids()
    for expected in (
        "preview-strip",
        "plot-latents",
        "plot-denoiser",
        "plot-components",
        "plot-memory",
        "plot-anomaly-kinds",
    ):
        assert expected in figures
    assert figures.index("preview-strip") == 0
    for image in inference_page.images:
        assert image.section == "plots"
        decoded = _decode(image.src)
        assert decoded.width > (100 if image.src.startswith(PNG) else 30) and decoded.height > 30
        pixels = np.asarray(decoded.convert("L"))
        assert pixels.std() > 0, f"{image.figure} is blank"
        assert image.alt


def test_preview_strip_is_the_saved_file(inference_run_dir, inference_page):
    strip = next(i for i in inference_page.images if i.figure == "preview-strip")
    assert base64.b64decode(strip.src[len(PNG) :]) == (inference_run_dir / "previews" / "strip.png").read_bytes()


def test_preview_caption_says_from_the_record_where_the_latents_broke(inference_run_dir):
    """A dark tile is no fault (a finite run shows some): the caption names the step from the counts."""
    from diffusion_debug.report.media import first_nonfinite_latents

    steps = json.loads((inference_run_dir / "summary.json").read_text())["steps"]
    broken = [
        row["step"] for row in steps if row["latents"]["nan"] + row["latents"]["posinf"] + row["latents"]["neginf"]
    ]
    assert broken and first_nonfinite_latents(steps) == broken[0]
    text = (inference_run_dir / "report.html").read_text()
    assert f"The latents held NaN/Inf from step {broken[0]} on." in text and "black or flat tiles" not in text
    finite = [{"step": 0, "latents": {"nan": 0, "posinf": 0, "neginf": 0}}]
    assert first_nonfinite_latents(finite) is None


def test_no_external_resources(inference_run_dir, training_run_dir, inference_page, training_page):
    for page in (inference_page, training_page):
        for url in page.resource_urls:
            assert url.startswith(PNG) or url.startswith(GIF) or url.startswith("#"), url[:80]
        assert not page.tags & {"script", "link", "iframe", "object", "embed"}
    for run_dir in (inference_run_dir, training_run_dir):
        text = (run_dir / "report.html").read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text
        assert re.search(r"""(src|href)\s*=\s*['"]?//""", text) is None


def test_step_table_marks_nonfinite_steps(inference_run_dir):
    text = (inference_run_dir / "report.html").read_text(encoding="utf-8")
    rows = re.findall(r"<tr( class='flag')?><td class='num'>(\d+)</td>", text.split("id='steps'")[1])
    flagged = {int(step) for flag, step in rows if flag}
    assert flagged == {2, 3}  # Inf from step 2 on, 4 steps


def test_step_animation_is_the_saved_gif(inference_run_dir, inference_page):
    gif = next(i for i in inference_page.images if i.figure == "steps-gif")
    assert gif.src.startswith(GIF)
    assert base64.b64decode(gif.src[len(GIF) :]) == (inference_run_dir / "previews" / "steps.gif").read_bytes()


def _copy(run_dir, tmp_path):
    copy = tmp_path / "out" / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


def test_final_image_and_vae_previews_are_embedded(inference_run_dir, tmp_path):
    copy = _copy(inference_run_dir, tmp_path)
    Image.new("RGB", (32, 32), (200, 30, 30)).save(copy / "image.png")
    (copy / "images").mkdir()
    Image.new("RGB", (32, 32), (30, 200, 30)).save(copy / "images" / "1.png")
    shutil.copy(copy / "previews" / "strip.png", copy / "previews" / "vae_strip.png")
    page = read_page(write_html(copy).read_text(encoding="utf-8"))
    figures = page.figure_ids()
    assert figures.index("preview-strip") < figures.index("final-image-0") < figures.index("vae-preview-strip")
    by_figure = {i.figure: i for i in page.images}
    for figure, name in (("final-image-0", "image.png"), ("final-image-1", "images/1.png")):
        assert base64.b64decode(by_figure[figure].src[len(PNG) :]) == (copy / name).read_bytes()
    vae = base64.b64decode(by_figure["vae-preview-strip"].src[len(PNG) :])
    assert vae == (copy / "previews" / "vae_strip.png").read_bytes()


def test_a_picture_linked_from_outside_the_run_is_not_embedded(inference_run_dir, tmp_path):
    copy = _copy(inference_run_dir, tmp_path)
    Image.new("RGB", (8, 8)).save(tmp_path / "private.png")
    (copy / "image.png").symlink_to(tmp_path / "private.png")
    page = read_page(write_html(copy).read_text(encoding="utf-8"))
    assert "final-image-0" not in page.figure_ids()


def test_replay_command_runs_as_printed_from_here(inference_run_dir, tmp_path, monkeypatch, capsys):
    from diffusion_debug.cli import main

    copy = _copy(inference_run_dir, tmp_path)
    (copy / "invocation.json").write_text('{"command": "run", "model": null, "kind": "sd"}')
    monkeypatch.chdir(tmp_path)
    text = write_html(copy).read_text(encoding="utf-8")
    (command,) = re.findall(r"<code>(diffusion-debug replay [^<]*)</code>", text)
    bundle = next(p for p in (copy / "bundles").iterdir())
    assert command == f"diffusion-debug replay out/{copy.name}/bundles/{bundle.name} --kind sd"
    code = main(shlex.split(command)[1:])
    out = capsys.readouterr().out
    # the tiny weights do not hold the planted hook, so the replay stays finite: but it ran
    assert (code, out.split(":")[0]) in ((0, "first non-finite value"), (1, "the replay stayed finite"))


def test_replay_command_names_the_model_directory(inference_run_dir, tmp_path, monkeypatch):
    copy = _copy(inference_run_dir, tmp_path)
    (copy / "invocation.json").write_text(dumps({"command": "run", "model": str(tmp_path / "my-pipe")}))
    monkeypatch.chdir(tmp_path / "out")
    text = write_html(copy).read_text(encoding="utf-8")
    (command,) = re.findall(r"<code>(diffusion-debug replay [^<]*)</code>", text)
    # the bundle lies under the current directory (relative), the model outside it (absolute)
    assert command.startswith(f"diffusion-debug replay {copy.name}/bundles/")
    assert command.endswith(f" --model {tmp_path / 'my-pipe'}")


def test_nan_steps_are_marked_in_the_memory_plot_and_memory_says_what_it_measures(inference_run_dir):
    run = load_run(inference_run_dir)
    plots = {plot.id: plot for plot in build_plots(run.summary)[0]}
    memory = np.asarray(Image.open(io.BytesIO(plots["plot-memory"].png)).convert("RGB")).astype(int)
    red = (abs(memory[..., 0] - 0xF6) < 12) & (abs(memory[..., 1] - 0xD4) < 12) & (abs(memory[..., 2] - 0xD4) < 12)
    assert red.sum() > 100  # the pale red bands of steps 2 and 3
    assert "process RSS (on CPU: the whole process" in plots["plot-components"].caption
    assert "<th>process RSS MB (peak)</th>" in (inference_run_dir / "report.html").read_text(encoding="utf-8")
    assert "red crosses" in plots["plot-denoiser"].caption


# -- training -----------------------------------------------------------------------------


def test_training_report_has_its_plots(training_page):
    figures = training_page.figure_ids()
    for expected in (
        "plot-loss",
        "plot-grad-norm",
        "plot-lr",
        "plot-module-grads",
        "plot-timestep-buckets",
        "plot-memory",
        "plot-anomaly-kinds",
    ):
        assert expected in figures
    alts = {i.figure: i.alt for i in training_page.images}
    assert alts["plot-loss"] == "Training loss per step with anomaly steps marked"
    assert "before clipping" in alts["plot-grad-norm"]
    assert alts["plot-timestep-buckets"] == "Bar chart of mean loss per timestep bucket with counts"
    for image in training_page.images:
        assert np.asarray(_decode(image.src).convert("L")).std() > 0


def test_training_nan_gradient_is_listed(training_page):
    anomalies = training_page.section_text["anomalies"]
    assert f"parameter encoder.weight · step {NAN_GRAD_STEP}" in anomalies
    assert "module encoder" in anomalies


def test_training_tables(training_run_dir, training_page):
    run = load_run(training_run_dir)
    steps_text = training_page.section_text["steps"]
    assert f"Steps ({len(run.steps)} recorded)" in steps_text
    assert "grad norm" in steps_text and "loss" in steps_text
    components = training_page.section_text["components"]
    assert "Largest gradient norms per module" in components
    largest = max(run.summary["components"]["model"]["module_grad_norm_max"].items(), key=lambda i: i[1])
    assert f"{largest[0]} {largest[1]:.4g}" in components


# -- the files, and only the files --------------------------------------------------------


def test_rebuilt_from_a_copied_run_directory(inference_run_dir, tmp_path):
    copy = tmp_path / "elsewhere" / inference_run_dir.name
    shutil.copytree(inference_run_dir, copy)
    (copy / "report.html").unlink()  # in the copy only: the rebuild must write it anew
    # the caller's matplotlib backend is theirs: the plots draw on their own Agg canvas
    code = (
        "import matplotlib; matplotlib.use('svg'); from diffusion_debug.report import write_html; "
        f"write_html({str(copy)!r}); print(matplotlib.get_backend())"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert done.stdout.strip() == "svg"
    text = (copy / "report.html").read_text(encoding="utf-8")
    page = read_page(text)
    assert PLANTED_MODULE in page.section_text["anomalies"]
    assert str(copy) in text
    assert str(inference_run_dir) not in text  # nothing points back at the original directory
    strip = next(i for i in page.images if i.figure == "preview-strip")
    assert base64.b64decode(strip.src[len(PNG) :]) == (copy / "previews" / "strip.png").read_bytes()


def test_saved_json_is_untouched_and_strict(training_run_dir):
    files = [training_run_dir / "summary.json", training_run_dir / "events.jsonl"]
    before = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    write_html(training_run_dir)
    assert [hashlib.sha256(f.read_bytes()).hexdigest() for f in files] == before
    loads(files[0].read_text(encoding="utf-8"))
    for line in files[1].read_text(encoding="utf-8").splitlines():
        loads(line)


# -- edge cases, on made-up summaries -----------------------------------------------------


def test_no_anomalies_is_said_plainly(tmp_path):
    run_dir = _write_run(tmp_path / "clean", {"kind": "diffusion", "anomalies": [], "steps": []})
    page = read_page(write_html(run_dir).read_text(encoding="utf-8"))
    assert page.section_text["anomalies"] == ("Anomalies No anomalies: the debugger found nothing wrong in this run.")
    assert page.images == []
    assert "No steps were recorded." in page.section_text["steps"]


def test_missing_and_malformed_fields_leave_plots_out(tmp_path):
    summary = {
        "kind": "training",
        "steps": [
            {"step": 0, "memory": 5, "learning_rates": "oops", "top_module_grad_norms": []},
            {"step": 1, "loss": "nan", "grad_norm": None},
        ],
        "components": {"model": {"loss_by_timestep_bucket": "oops", "module_grad_norm_max": {"a": "inf"}}},
        "anomaly_counts": {"loss_spike": "many"},
    }
    plots, failures = build_plots(summary)
    assert failures == []
    assert [p.id for p in plots] == ["plot-loss"]  # one NaN loss is still worth a marker
    page = read_page(write_html(_write_run(tmp_path / "odd", summary)).read_text(encoding="utf-8"))
    assert page.figure_ids() == ["plot-loss"]


def test_text_is_escaped(tmp_path):
    hostile = Anomaly(
        "debugger_error",
        "warning",
        "<script>alert(1)</script> & more",
        component="unet",
        module="<img src=x>",
        step=1,
        details={"<k>": "<v>"},
    )
    run_dir = _write_run(
        tmp_path / "<b>run</b>",
        {"kind": "diffusion", "anomalies": [hostile.to_dict()], "steps": [{"step": 0, "note": "<i>"}]},
    )
    text = write_html(run_dir).read_text(encoding="utf-8")
    assert "<script" not in text and "<img src=x>" not in text and "<b>run</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in text
    assert "&lt;img src=x&gt;" in text


def test_quotes_are_escaped_as_html_escape_spells_them(tmp_path):
    # pages and tests compare with html.escape's &quot; and &#x27;, not markupsafe's &#34; and &#39;
    message = """The input 'x' holds inputs["pixel_values"]."""
    anomaly = Anomaly("nonfinite_input", "error", message, parameter='inputs["pixel_values"]', step=0)
    run_dir = _write_run(tmp_path / "quotes", {"kind": "training", "anomalies": [anomaly.to_dict()]})
    text = write_html(run_dir).read_text(encoding="utf-8")
    assert html.escape(message) in text and html.escape(f"Most important: {anomaly.kind} at {anomaly.where()}") in text
    assert "&#34;" not in text and "&#39;" not in text


def test_repeated_anomalies_share_one_card(tmp_path):
    anomalies = [
        Anomaly("nonfinite_loss", "error", f"The loss is nan at step {s}.", component="model", step=s)
        for s in (3, 4, 5, 9)
    ]
    run_dir = _write_run(tmp_path / "repeats", {"kind": "training", "anomalies": [a.to_dict() for a in anomalies]})
    text = write_html(run_dir).read_text(encoding="utf-8")
    assert text.count("<li class='anomaly error'>") == 1
    assert "repeated 4 times, at steps 3–5, 9" in read_page(text).section_text["anomalies"]


def test_heatmap_binning_keeps_spikes_and_nonfinite():
    steps = 1000
    values = np.ones((2, steps))
    values[0, 617] = 1e6
    bad = np.zeros((2, steps), dtype=bool)
    bad[1, 999] = True
    binned, binned_bad, x = _bin_columns(values, bad, np.arange(steps, dtype=float), HEATMAP_MAX_COLUMNS)
    assert binned.shape == (2, HEATMAP_MAX_COLUMNS) and x.shape == (HEATMAP_MAX_COLUMNS,)
    assert binned[0].max() == 1e6 and binned_bad[1, -1] and binned_bad.sum() == 1
    assert x[0] == 0 and x[-1] < steps


def test_long_run_is_bounded(tmp_path):
    rng = np.random.default_rng(0)
    modules = [f"down_blocks.{i // 8}.resnets.{i % 8}.conv1" for i in range(40)]
    steps = [
        {
            "step": s,
            "loss": float(rng.random()) if s % 97 else "nan",
            "grad_norm": float(rng.random() * 5),
            "learning_rates": [1e-4],
            "memory": {"rss_mb": 400 + s * 0.01},
            "top_module_grad_norms": {m: float(rng.random()) for m in rng.choice(modules, 5, replace=False)},
        }
        for s in range(1000)
    ]
    anomalies = [
        Anomaly("nonfinite_loss", "error", "nan", component="model", step=s).to_dict() for s in range(0, 1000, 97)
    ]
    run_dir = _write_run(tmp_path / "long", {"kind": "training", "steps": steps, "anomalies": anomalies})
    text = write_html(run_dir).read_text(encoding="utf-8")
    page = read_page(text)
    assert "plot-module-grads" in page.figure_ids()
    assert "… 970 steps not shown (all are in summary.json) …" in page.section_text["steps"]
    assert len(text) < 2_000_000


def test_guide_covers_every_stable_kind():
    assert set(STABLE_KINDS) | {"debugger_error"} <= set(KINDS)
    table = guide_markdown()
    assert table.count("\n") == len(KINDS) + 1
    assert "| `rank_desync` |" in table


def test_the_why_note_is_on_the_page_beside_its_verdict(inference_run_dir, tmp_path):
    """What the replays of ``why`` could not reproduce (``WhyResult.note``, in why.md and why.json) is on
    report.html too, read from why.json: under the verdict it qualifies and in the files section."""
    from diffusion_debug.diffusion.replay.bundle import uncached_note
    from diffusion_debug.diffusion.replay.why import Replay, WhyResult, write_why

    run_dir = shutil.copytree(inference_run_dir, tmp_path / "run")
    verdict = "smallest fix: float32 (dtype) makes transformer finite"
    as_is = Replay("as is", "", False, None, "float16", 65504.0)
    note = uncached_note("transformer")
    write_why(run_dir, WhyResult("transformer", "proj_out", 1, as_is, [], verdict, note=note))
    assert note in (run_dir / "why.md").read_text()
    page = write_html(run_dir).read_text(encoding="utf-8")
    header = f"<b>why:</b> {html.escape(verdict)} (<a href='why.md'>the replays</a>)<br>{html.escape(note)}</p>"
    files = f"(<a href='why.json'>why.json</a>)</p><p class='note'>{html.escape(note)}</p>"
    assert header in page and files in page
    write_why(run_dir, WhyResult("transformer", "proj_out", 1, as_is, [], verdict))  # no note: none shown
    page = write_html(run_dir).read_text(encoding="utf-8")
    assert "(<a href='why.md'>the replays</a>)</p>" in page and "replayed without its caching hooks" not in page


def test_a_kinds_split_counts_its_anomalies_as_their_cards_chips_show_them(tmp_path):
    """A warning that an error follows from heads a diagnosis of error: its card's chip says error, and its kind's
    split said "1 warning" (the anomaly's own severity) above it; now both say error. The verdict's chips keep
    the record's own severities (summary.json's severity_counts, the terminal's count)."""
    from diffusion_debug.record import cause_reference

    lr = {"reason": "lr_jump", "lr_before": 1e-4, "lr": 1.0, "factor": 1e4}
    jump = Anomaly("lr_spike", "warning", "The learning rate jumped.", component="optimizer", step=10, details=lr)
    cause = {"cause": cause_reference(jump)}
    nan = Anomaly("nonfinite_loss", "error", "The loss is nan.", "model", step=16, details=cause)
    run_dir = _write_run(tmp_path / "split", {"kind": "training", "anomalies": [jump.to_dict(), nan.to_dict()]})
    text = write_html(run_dir).read_text(encoding="utf-8")
    assert "<h3>lr_spike <span class='count'>× 1 (1 error)</span></h3>" in text
    card = text[text.index("<li class='anomaly ") :]
    assert card.startswith("<li class='anomaly error'><span class='chip error'>error</span>")
    verdict = "<span class='chip error'>1 error</span><span class='chip warning'>1 warning</span>"
    assert verdict in text.replace("\n", "")
