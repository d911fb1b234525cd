"""Memory plans (issue #27): the phased and streamed renders are bit-equal to the all-resident one, a prompt that
fails to encode in the text phase fails its job alone, the text store spills past its bound, the chooser picks the
expected plan for given memory sizes (and its size model matches the H200 measurements), refuses in one line
before loading, and the sidecar records the plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3render import memplan
from h3render.batch import run_batch
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.releases import RELEASES
from h3render.engine import Engine
from h3render.jobs import Job
from h3render.parallel.groups import ParallelContext
from h3render.settings import RunSettings
from h3render.render import generate
from h3render.tasks import t2va
from h3render.tasks.base import Encoded
from h3render.timing import StageTimer
from h3render.text_phase import TextStore
from tests._cli import invoke, one_error_line

CPU = ParallelContext(0, 1, 0, torch.device("cpu"))
REPO = Path(__file__).resolve().parents[2]


def _job(name: str, prompt: str, seed: int) -> Job:
    return Job(id=name, prompt=prompt, width=128, height=64, frames=22, seed=seed, steps=2, mode="t2va",
               output=name)


A = _job("a", "Rain on a tin roof", 3)
B = _job("b", "A kettle whistles", 4)
C = _job("c", "", 5)  # tokenizes to nothing: fails in the text phase
GOOD = (A, B)


def _latents(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.latents.pt")


@pytest.fixture(scope="module")
def renders(tmp_path_factory):
    """A's latents from the resident engine (denoise only: no MP4 needed for the reference); a phased queue
    A, B, C through `run_batch` with the runner's warm-up; A streamed through `h3render prompt`."""
    info = read_checkpoint_info("tiny")
    base = RunSettings(progress=False, save_latents=True)
    engine = Engine.load(base, CPU)
    timer = StageTimer(engine.device)
    latents = generate(engine, A, t2va.prepare(engine, A, timer), engine.schedule(A), timer)
    out = {"resident": {"video": latents.video, "audio": latents.audio}}
    del engine
    engines = {}
    run, chosen = memplan.plan_run(replace(base, memory_plan="phased"), info, [A, B, C])
    out["phased"] = tmp_path_factory.mktemp("phased")

    def factory():
        engine = engines["phased"] = Engine.load(run, CPU, jobs=[A, B, C])
        engine.prepare([A, B, C])  # as the runner does: the warm-up's task prepare reads the text store too
        return engine

    out["phased_report"] = run_batch([A, B, C], factory, out["phased"], quiet=True, progress=False)
    # streamed through the command line (the runner's load, `prompt`), in this process
    out["streamed"] = tmp_path_factory.mktemp("streamed")
    out["streamed_cli"] = invoke("prompt", A.prompt, "-o", str(out["streamed"] / "a.mp4"), "--device", "cpu",
                                 "--memory-plan", "streamed", "--width", "128", "--height", "64", "--frames", "22",
                                 "--steps", "2", "--seed", "3", "--save-latents")  # not --quiet: it hides the plan line
    return out, engines


def test_phased_and_streamed_renders_equal_the_resident_one(renders):
    out, engines = renders
    assert out["streamed_cli"].exit_code == 0, out["streamed_cli"].output
    ref = out["resident"]
    for plan in ("phased", "streamed"):
        got = _latents(out[plan], "a")
        assert torch.equal(got["video"], ref["video"]) and torch.equal(got["audio"], ref["audio"]), plan
    assert engines["phased"].c.text_encoder is None and engines["phased"].streamer is None  # the encoder was freed
    warmup = json.loads((out["streamed"] / "a.json").read_text())["extra"]["warmup"]
    assert warmup["dit_streaming"]["layers"] == 2 and warmup["text_phase"]["streamed"]["layers"] == 50


def test_layers_stream_through_two_slots_bit_exactly():
    """`LayerStreamer` over 3 layers (odd: the wrap-around prefetch lands in the slot the last layer left) and over
    the tiny DiT's blocks: the same outputs as resident, one copy per layer per forward, no resident copy left."""
    import copy

    from h3render.block_stream import stream_layers_
    from h3render.checkpoint.load import build_tiny
    from h3render.packing import t2va_layout

    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    x = torch.randn(4, 8)
    ref = stack(x)
    streamer = stream_layers_(stack, torch.nn.ModuleList(list(stack)), torch.device("cpu"))
    for forward in range(3):
        assert torch.equal(stack(x), ref)
    # layer 0 on demand once, then each layer's copy ahead of it (the last one's: layer 0 of the next forward)
    assert streamer.copies == 1 + 3 * 3 and all(p.numel() == 0 for p in stack.parameters())
    dit = build_tiny(parts=("dit",)).dit
    layout = t2va_layout(5, 64, 128, 22)
    tables = dit.modulation_tables(torch.tensor([0.0, 0.5]))
    args = (torch.randn(layout.video_index.numel(), dit.cfg.video_patch_dim),
            torch.randn(layout.audio_index.numel(), dit.cfg.audio_in_channels), torch.randn(5, dit.cfg.text_dim),
            layout, tables, torch.ones(layout.seq_len, dtype=torch.long))
    ref = dit(*args)
    streamed = copy.deepcopy(dit)
    streamer = stream_layers_(streamed, streamed.blocks, torch.device("cpu"), keep=("adaln_proj",))
    for forward in range(2):
        got = streamed(*args)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert streamer.copies == 1 + 2 * len(dit.blocks)
    assert streamed.blocks[0].adaln_proj.linear.weight.numel() > 0  # kept: the tables read it


def test_a_prompt_that_fails_to_encode_fails_its_job_alone(renders):
    out, engines = renders
    report = out["phased_report"]
    assert [j.status for j in report.jobs] == ["succeeded", "succeeded", "failed"]
    assert "failed to encode in the text phase: ValueError: prompt is empty" in report.jobs[2].error
    phase = engines["phased"].warmup["text_phase"]
    assert phase["prompts"] == 2 and phase["failed"] == 1 and phase["host_bytes"] > 0
    assert (out["phased"] / "b.mp4").is_file() and not (out["phased"] / "c.mp4").exists()


def test_the_text_phase_encodes_only_what_the_queue_will_render(renders):
    """Resume stays per job: the runner hands the text phase the jobs whose outputs are not complete."""
    from h3render.runner import Queue, to_render

    out, _ = renders
    assert to_render([A, B, C], Queue(str(out["phased"]))) == [C]  # A and B are rendered, C failed
    assert to_render([A, B, C], Queue(str(out["phased"]), overwrite=True)) == [A, B, C]


def test_the_sidecar_records_the_plan(renders):
    jsonschema = pytest.importorskip("jsonschema")
    out, _ = renders
    schema = json.loads((REPO / "docs/schema/sidecar.schema.json").read_text())
    assert "h3render: memory plan streamed fp32: " in out["streamed_cli"].stderr  # the log line of the CLI run
    for plan in ("phased", "streamed"):
        side = json.loads((out[plan] / "a.json").read_text())
        jsonschema.validate(side, schema)
        memory = side["run"]["memory"]
        assert memory["plan"] == plan
        assert side["run"]["dtypes"]["text_encoder"] == "float32"  # from the text phase when the encoder is freed
        assert side["run"]["precision_components"]["text_encoder"].startswith("fp32")
        assert memory["reason"] == f"--memory-plan {plan}" and memory["expected_peak_gb"] >= 0
        assert memory["canvas"] == "128x64x22" and memory["limit_gb"] is None
        assert side["extra"]["warmup"]["memory_plan"] == plan


def test_the_text_store_spills_past_its_bound(tmp_path):
    store = TextStore(bound=100 * 4, spill_dir=tmp_path)  # room for one [1, 100] float32 entry
    first, second = torch.arange(100.0)[None], torch.arange(200.0).view(2, 100)
    store.put("x", Encoded(first, "kept"))
    store.put("y", Encoded(second, {"extra": 1}))
    assert store.host_bytes == 400 and store.disk_bytes > 0 and len(list(tmp_path.rglob("*.pt"))) == 1
    got = store.get("y", torch.device("cpu"))
    assert torch.equal(got.states, second) and got.extra == {"extra": 1}
    assert store.get("x", torch.device("cpu")).extra == "kept"
    folder = next(tmp_path.iterdir())
    store.close()
    assert not folder.exists()


# -- the chooser, at the released sizes ---------------------------------------------------------------------------

RELEASED = RELEASES["released"]
BIG = SimpleNamespace(width=1344, height=768, frames=243, pass_frames=243, task="t2va")  # the 10.125 s 1344x768 clip
AMPERE = "FP8 GEMMs need compute capability 8.9 or newer"


@pytest.fixture(scope="module")
def sizes():
    from h3render.checkpoint.sizes import part_sizes

    return {p: part_sizes(RELEASED, p, vsa=True) for p in ("bf16", "fp8")}  # what the chooser tests use


def test_the_size_model_matches_the_h200_measurements(sizes):
    """docs/performance.md §9.3/§9.4: resident GB per part; §19: the denoise peaks of the 1344x768x243 VSA render
    (256 text rows) in each plan measured, which the chooser may overestimate by a little, never underestimate."""
    measured = {("bf16", "text_encoder"): 50.32, ("bf16", "dit"): 40.20, ("fp8", "text_encoder"): 25.95,
                ("fp8", "dit"): 20.95, ("bf16", "video_vae"): 5.57, ("bf16", "audio_vae"): 0.61}
    cfg = RELEASED.dit
    gates = cfg.num_layers * cfg.num_attention_heads * cfg.attention_head_dim * cfg.hidden_size  # VSA gate weights
    for (precision, part), gb in measured.items():
        got = sizes[precision][part].resident - (gates * (2 if precision == "bf16" else 1) if part == "dit" else 0)
        assert got / 1e9 == pytest.approx(gb, rel=0.01), (precision, part)
    assert sizes["bf16"]["dit"].resident / 1e9 == pytest.approx(44.06, rel=0.01)  # with the gates, measured too
    assert sizes["fp8"]["video_vae"].resident < 0.6 * sizes["bf16"]["video_vae"].resident  # FP8 decoder linears
    peaks = {("bf16", "resident"): 110.56, ("fp8", "resident"): 62.18, ("bf16", "phased"): 60.19,
             ("fp8", "streamed"): 12.68}
    for (precision, plan), gb in peaks.items():
        phases = memplan.expected_phases(sizes[precision], plan, memplan.Canvas(1344, 768, 243, 256), 5376,
                                         text_hidden=5120, text_intermediate=25600)
        assert gb <= phases["denoise"] / 1e9 <= gb * (1.01 if plan != "streamed" else 1.04), (precision, plan)


@pytest.mark.parametrize("gb, problem, given, plan", [
    (140.8, None, False, "resident bf16"),  # an H200 less the reserve
    (80, None, False, "phased bf16"),  # H100 80 GB
    (48, None, False, "phased fp8"),  # L40S
    (24, None, False, "streamed fp8"),  # a 24 GB card
    (80, AMPERE, False, "phased bf16"),  # A100 80 GB
    (40, AMPERE, False, "streamed bf16"),  # A100 40 GB: no fp8 rung
    (48, None, True, "streamed bf16"),  # --precision bf16 given: the chooser keeps it
])
def test_the_chooser_picks_the_expected_plan(sizes, gb, problem, given, plan):
    chosen = memplan.choose(RELEASED, [BIG], limit=int(gb * 1e9), limit_source="--max-gpu-memory",
                            fp8_problem=problem, precision_given=given, vsa=True)
    assert chosen.label == plan and chosen.peak <= gb * 1e9
    assert f"memory plan {plan}: " in chosen.log_line() and chosen.record()["plan"] == plan.split()[0]
    if problem is not None:
        assert f"fp8 plans refused here ({AMPERE})" in chosen.reason


def test_the_chooser_refuses_what_cannot_fit(sizes):
    with pytest.raises(memplan.PlanError) as caught:
        memplan.choose(RELEASED, [BIG], limit=int(12e9), limit_source="--max-gpu-memory", vsa=True)
    assert str(caught.value).startswith("no memory plan fits 12.0 GB (--max-gpu-memory) for the 1344x768x243 job: "
                                        "the smallest, streamed fp8, needs 13.2 GB expected peak (text 2.6, "
                                        "denoise 13.2, decode 8.4)")
    with pytest.raises(memplan.PlanError, match=r"^--memory-plan resident does not fit 80.0 GB .* job: resident "
                                                r"bf16 needs 110.6 GB"):
        memplan.choose(RELEASED, [BIG], asked="resident", limit=int(80e9), limit_source="--max-gpu-memory", vsa=True)


def test_the_cli_refuses_before_loading(tmp_path):
    line = one_error_line(invoke("prompt", "a cat", "-o", str(tmp_path / "a.mp4"), "--device", "cpu",
                                 "--max-gpu-memory", "0.0001", "--frames", "22"))
    assert line.startswith("h3render: error: no memory plan fits 0.0001 GB (--max-gpu-memory) for the ") and \
        "the smallest, streamed fp32, needs" in line  # fp32 activations on CPU: no fp8 rung
    assert list(tmp_path.iterdir()) == []
    line = one_error_line(invoke("prompt", "a cat", "-o", str(tmp_path / "b.mp4"), "--max-gpu-memory", "0"))
    assert line == "h3render: error: --max-gpu-memory 0.0: GB of device memory, must be > 0"


def test_the_plan_line_names_the_dtype_the_run_computes_in(tmp_path):
    """A fresh-user trial: a CPU run (fp32) logged "memory plan resident bf16", `--precision bf16`'s "no FP8" read
    as the weights' dtype. The label is the dtype, or fp8, and so is the sidecar's `run.memory.precision`."""
    jobs = [SimpleNamespace(width=224, height=128, frames=39, pass_frames=39, task="t2va")]
    tiny = RELEASES["tiny"]
    for dtype, precision, label in (("fp32", "bf16", "resident fp32"), ("bf16", "bf16", "resident bf16"),
                                    ("bf16", "fp8", "resident fp8")):
        plan = memplan.choose(tiny, jobs, precision=precision, precision_given=True, limit=int(10e9),
                              limit_source="--max-gpu-memory", dtype=dtype)
        assert plan.label == label and plan.log_line().startswith(f"h3render: memory plan {label}: "), plan.log_line()
        assert plan.record()["precision"] == label.split()[1]
    fp32 = memplan.choose(tiny, jobs, dtype="fp32").phases["denoise"]  # and the peaks were fp32's all along
    assert fp32 > memplan.choose(tiny, jobs, dtype="bf16").phases["denoise"]
    r = invoke("prompt", "a cat", "-o", str(tmp_path / "a.mp4"), "--device", "cpu", "--max-gpu-memory", "10",
               "--frames", "22", "--width", "128", "--height", "64", "--steps", "2")
    assert r.exit_code == 0, r.output
    plan_line = next(line for line in r.stderr.splitlines() if line.startswith("h3render: memory plan "))
    assert plan_line.startswith("h3render: memory plan resident fp32: "), plan_line


def test_fl2va_presentations_encode_in_a_streamed_text_phase(tmp_path):
    """An fl2va job's presentation (vision tower loaded in the text phase) through the streamed text encoder equals
    its encode on the resident one, and its `Presentation` comes back from the store."""
    import numpy as np
    from PIL import Image

    from h3render.checkpoint.load import load_components
    from h3render.manifest import job_from_fields
    from h3render.tasks import fl2va
    from h3render.text_phase import TextHost, run_text_phase

    png = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(png)
    info = read_checkpoint_info("tiny")
    job = job_from_fields({"prompt": "A door opens", "first_frame": str(png), "output": "f", "frames": 22},
                          info.limits())
    ref = fl2va.encode_text(TextHost(load_components("tiny", parts=("text_encoder",)), CPU.device), job)
    store, record = run_text_phase(RunSettings(progress=False), CPU.device, [job], streamed=True)
    got = store.get(fl2va.text_key(job), CPU.device)
    assert torch.equal(got.states, ref.states) and got.extra.describe() == ref.extra.describe()
    assert record["vision_load_s"] > 0 and record["streamed"]["layers"] == 50 and record["prompts"] == 1



def test_capped_and_phased_plans_ask_for_expandable_segments(monkeypatch):
    """The streamed fp8 render at a 22 GB cap ran out of memory with ~10 GB live and the rest of 20.4 GiB reserved
    in cut-up fixed segments; with expandable segments it peaked at 15.84 GB (H200, docs/performance.md §18.3). Under
    a cap or a phased / streamed plan on CUDA the allocator is switched (unless PYTORCH_CUDA_ALLOC_CONF says
    otherwise); the uncapped resident plan and the CPU are left alone."""
    import torch

    from h3render.engine import fit_allocator

    asked = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", asked.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = torch.device("cuda")
    assert [fit_allocator(cuda, plan, capped) for plan, capped in (
        ("resident", False), ("resident", True), ("phased", False), ("streamed", False))] == \
        [None, "expandable_segments", "expandable_segments", "expandable_segments"]
    assert asked == ["expandable_segments:True"] * 3
    assert fit_allocator(torch.device("cpu"), "streamed", True) is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert fit_allocator(cuda, "streamed", True) is None and len(asked) == 3
