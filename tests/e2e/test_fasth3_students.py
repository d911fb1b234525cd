"""FastH3 students in every published layout (synthetic files written by our writers): adapter file, variant folder,
LoRA bundle root + variant, v1 / V2 full checkpoints; VSA on with the gates loaded (or an error naming the blocks);
FastVideo's key spellings and alpha; the unwrapped-module, base-model and positions rules; the sidecar's attention."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3render.checkpoint import adapter as fasth3
from h3render.checkpoint.adapter import read_adapter
from h3render.checkpoint.errors import AdapterError, CheckpointError
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.load import load_components
from h3render.checkpoint.releases import RELEASES
from h3render.checkpoint.students import plan_student, resolve_adapter
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter, write_synthetic_bundle
from h3render.make_checkpoint.writer import write_synthetic_full_student
from tests._spawn import cpu_rank, put_result, run_ranks

CFG = RELEASES["tiny"].dit
TINY = read_checkpoint_info("tiny")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_synthetic_bundle(tmp_path_factory.mktemp("b") / "FastH3-v1-LoRA", CFG, seed=11)


def load_dit(checkpoint, plan):
    return load_components(checkpoint, "cpu", torch.float32, parts=("dit",), tensor_hook=plan.hook).dit


def gate_of(path, i):
    return load_file(path)[f"transformer_blocks.{i}.attn.to_gate_compress.set_weight"]


def rewrite(path, edit):
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(path)
    edit(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


# ---------------------------------------------------------------------------------------------- layouts


def test_every_adapter_layout_resolves(bundle, tmp_path):
    src = resolve_adapter(bundle, "vsa-datafree")
    assert (src.layout, src.variant, src.file) == ("bundle", "vsa-datafree",
                                                   bundle / "vsa-datafree" / "adapter_model.safetensors")
    folder = resolve_adapter(bundle / "dense-datafree")
    assert (folder.layout, folder.variant, folder.manifest_path) == ("variant folder", "dense-datafree",
                                                                     bundle / "adapter_manifest.json")
    inner = resolve_adapter(bundle / "vsa-synthetic-step1900" / "adapter_model.safetensors")
    assert (inner.layout, inner.variant) == ("file", "vsa-synthetic-step1900")  # the root's manifest applies
    lone = write_synthetic_adapter(tmp_path / "x.safetensors", CFG, seed=1)
    assert resolve_adapter(lone).manifest is None
    with pytest.raises(AdapterError, match="dense-datafree, vsa-datafree, vsa-synthetic-step1300, "
                                           "vsa-synthetic-step1900"):
        resolve_adapter(bundle)
    with pytest.raises(AdapterError, match="no variant 'vsa'"):
        resolve_adapter(bundle, "vsa")
    with pytest.raises(AdapterError, match="needs a bundle folder"):
        resolve_adapter(lone, "vsa-datafree")


def test_bundle_variants_load_vsa_with_their_gates_and_dense_stays_dense(bundle):
    plan = plan_student("tiny", TINY, bundle, variant="vsa-synthetic-step1300")
    att = plan.sidecar["attention"]
    assert att["mode"] == "vsa" and att["sparsity"] == 0.9 and att["tile"] == 64
    assert att["sparsity_source"].endswith("variants.vsa-synthetic-step1300.vsa_sparsity")
    dit = load_dit("tiny", plan)
    assert dit.vsa_sparsity == 0.9
    path = bundle / "vsa-synthetic-step1300" / "adapter_model.safetensors"
    for i in range(CFG.num_layers):
        torch.testing.assert_close(dit.blocks[i].attn.gate_proj.weight, gate_of(path, i).float(), rtol=0, atol=0)
    assert all(b.attn.gate_proj is None for b in dit.token_refiner.blocks)

    dense = plan_student("tiny", TINY, bundle, variant="dense-datafree")
    assert dense.sidecar["attention"]["mode"] == "dense" and dense.sidecar["variant"] == "dense-datafree"
    dit = load_dit("tiny", dense)
    assert dit.vsa_sparsity is None and not any("gate_proj" in k for k in dit.state_dict())


def test_sparsity_source_manifest_top_level_release_default_and_bad_tile(tmp_path):
    root = write_synthetic_bundle(tmp_path / "a", CFG, seed=2,
                                  manifest={"schema_version": "fasth3-lora-bundle-v1", "vsa_sparsity": 0.75})
    att = plan_student("tiny", TINY, root, variant="vsa-datafree").attention
    assert att.sparsity == 0.75 and att.sparsity_source.endswith("adapter_manifest.json vsa_sparsity")
    lone = write_synthetic_adapter(tmp_path / "v.safetensors", CFG, seed=3, with_set_weight=True)
    att = plan_student("tiny", TINY, lone).attention
    assert (att.sparsity, att.tile) == (0.9, 64) and "release notes" in att.sparsity_source
    root = write_synthetic_bundle(tmp_path / "b", CFG, seed=2, manifest={
        "schema_version": "fasth3-lora-bundle-v1", "variants": {"vsa-datafree": {"vsa_tile_size": 128}}})
    with pytest.raises(AdapterError, match="variants.vsa-datafree.vsa_tile_size=128.*must be 64"):
        plan_student("tiny", TINY, root, variant="vsa-datafree")
    (tmp_path / "b" / "adapter_manifest.json").write_text(json.dumps({"schema_version": "other"}))
    with pytest.raises(AdapterError, match="schema_version='other'"):
        plan_student("tiny", TINY, root, variant="vsa-datafree")


@pytest.mark.parametrize("student, layout, sparsity", [("v2", "diffusers", 0.8), ("v1-vsa-datafree", "official", 0.9),
                                                       ("v1-dense-datafree", "diffusers", None)])
def test_full_checkpoints_load_their_gates(tmp_path, student, layout, sparsity):
    ckpt = write_synthetic_full_student(tmp_path / student, student, layout=layout, seed=4)
    info = read_checkpoint_info(ckpt)
    plan = plan_student(str(ckpt), info)
    forwards = 8 if student == "v2" else 4
    assert plan.schedule.forwards == forwards and plan.sidecar["model_id"].startswith("FastVideo/")
    dit = load_dit(ckpt, plan)
    assert dit.vsa_sparsity == sparsity
    if sparsity is None:
        assert plan.sidecar["attention"]["mode"] == "dense"
        return
    assert plan.sidecar["attention"]["sparsity_source"].endswith("fastvideo_inference.json vsa_sparsity")
    transformer = ckpt / ("FL2VA" if layout == "official" else "") / "transformer"
    shard = transformer / "diffusion_pytorch_model-gates.safetensors"
    prefix = "transformer_blocks" if layout == "diffusers" else "blocks"
    written = load_file(shard)
    for i in range(CFG.num_layers):
        torch.testing.assert_close(dit.blocks[i].attn.gate_proj.weight,
                                   written[f"{prefix}.{i}.attn.to_gate_compress.weight"].float(), rtol=0, atol=0)


def test_full_checkpoint_missing_zero_gates_bad_tile_and_adapter_refused(tmp_path):
    ckpt = write_synthetic_full_student(tmp_path / "m", "v2", seed=4, gate_blocks=[0])
    with pytest.raises(CheckpointError, match=r"no VSA gate .* for blocks \[1\]"):
        load_dit(ckpt, plan_student(str(ckpt), read_checkpoint_info(ckpt)))
    ckpt = write_synthetic_full_student(tmp_path / "z", "v1-vsa-datafree", seed=4, zero_gates=[1])
    with pytest.raises(CheckpointError, match=r"gate .* of blocks \[1\] is all zero"):
        load_dit(ckpt, plan_student(str(ckpt), read_checkpoint_info(ckpt)))
    from h3render.make_checkpoint.synthetic_adapter import FULL_STUDENTS

    contract = {**FULL_STUDENTS["v1-vsa-datafree"], "vsa_tile_size": 256}
    ckpt = write_synthetic_full_student(tmp_path / "t", contract=contract, seed=4)
    with pytest.raises(AdapterError, match="vsa_tile_size=256.*must be 64"):
        plan_student(str(ckpt), read_checkpoint_info(ckpt))
    lone = write_synthetic_adapter(tmp_path / "a.safetensors", CFG, seed=1)
    ckpt = write_synthetic_full_student(tmp_path / "v", "v2", seed=4)
    with pytest.raises(AdapterError, match="takes no --adapter"):
        plan_student(str(ckpt), read_checkpoint_info(ckpt), lone)


def test_adapter_gate_missing_or_zero_names_the_blocks(tmp_path):
    path = write_synthetic_adapter(tmp_path / "g.safetensors", CFG, seed=6, with_set_weight=True)

    def drop_gate_1(tensors, meta):
        del tensors["transformer_blocks.1.attn.to_gate_compress.set_weight"]
        meta["set_weight_tensors"] = "1"
    rewrite(path, drop_gate_1)
    with pytest.raises(AdapterError, match=r"set_weight gate of blocks \[1\]"):
        plan_student("tiny", TINY, path)

    path = write_synthetic_adapter(tmp_path / "z.safetensors", CFG, seed=6, with_set_weight=True)
    rewrite(path, lambda t, m: t["transformer_blocks.0.attn.to_gate_compress.set_weight"].zero_())
    with pytest.raises(AdapterError, match=r"of blocks \[0\] is all zero"):
        load_dit("tiny", plan_student("tiny", TINY, path))


def test_deferred_in_place_fusion_turns_vsa_on_with_the_gates(bundle):
    from h3render.engine import Engine
    from h3render.settings import RunSettings
    from h3render.parallel.groups import ParallelContext

    ctx = ParallelContext(0, 1, 0, torch.device("cpu"))
    engine = Engine.load(RunSettings(progress=False, adapter=str(bundle), adapter_variant="vsa-datafree"), ctx,
                         base_jobs_first=True)
    assert engine.c.dit.vsa_sparsity is None  # base weights, dense, for the t2va jobs
    engine.fuse_student()
    dit = engine.c.dit
    assert dit.vsa_sparsity == 0.9
    path = bundle / "vsa-datafree" / "adapter_model.safetensors"
    torch.testing.assert_close(dit.blocks[1].attn.gate_proj.weight, gate_of(path, 1).float(), rtol=0, atol=0)


def test_a_failed_in_place_fusion_fails_every_later_fasth3_job(tmp_path):
    """`fuse_student` cleared its pending fusion before fusing: when a parameter failed half-way (factors within
    bounds whose product overflows, which only the fusion can see), the first fasth3 job failed and every later one
    rendered, "succeeded", on the half-fused DiT. Now each later one fails naming the fusion's error."""
    from h3render.engine import Engine
    from h3render.errors import RenderError
    from h3render.jobs import Job
    from h3render.parallel.groups import ParallelContext
    from h3render.settings import RunSettings

    path = write_synthetic_adapter(tmp_path / "o.safetensors", CFG, seed=6)
    from h3render.checkpoint.adapter_checks import MAX_ABS as big

    def overflow(tensors, meta):  # the last block's FFN output: parameters before it fuse first
        for role in ("lora_A", "lora_B"):
            key = f"transformer_blocks.{CFG.num_layers - 1}.ff.net.2.{role}.weight"
            tensors[key] = torch.full_like(tensors[key], big)
    rewrite(path, overflow)
    ctx = ParallelContext(0, 1, 0, torch.device("cpu"))
    engine = Engine.load(RunSettings(progress=False, adapter=str(path)), ctx, base_jobs_first=True)
    before = engine.c.dit.blocks[0].attn.qkv_proj.weight.clone()
    job = Job(id=None, prompt="x", width=224, height=128, frames=22, seed=0, steps=None, mode="fasth3",
              output="x")
    with pytest.raises(AdapterError, match="gives non-finite weights"):
        engine.schedule(job)
    assert not torch.equal(engine.c.dit.blocks[0].attn.qkv_proj.weight, before)  # half fused indeed
    with pytest.raises(RenderError, match="could not be fused.*AdapterError.*gives non-finite weights"):
        engine.schedule(job)


# ---------------------------------------------------------------------------------------------- FastVideo's semantics


def _fused(path, name):
    plan = plan_student("tiny", TINY, path)
    return load_dit("tiny", plan).state_dict()[name]


def test_alpha_scales_the_product_by_alpha_over_rank(tmp_path):
    path = write_synthetic_adapter(tmp_path / "a.safetensors", CFG, seed=7, rank=4)
    raw = load_file(path)
    product = (raw["transformer_blocks.0.attn.to_out.0.lora_B.weight"].double()
               @ raw["transformer_blocks.0.attn.to_out.0.lora_A.weight"].double())
    weight = torch.randn(CFG.hidden_size, CFG.num_attention_heads * CFG.attention_head_dim)  # fp32 base

    def delta():
        fusion = fasth3.AdapterFusion(read_adapter(path, base_model=fasth3.TINY_BASE_MODEL), CFG)
        return fusion("blocks.0.attn.out_proj.weight", weight).double() - weight.double()
    torch.testing.assert_close(delta(), product, rtol=0, atol=1e-6)  # no alpha: scale 1
    rewrite(path, lambda t, m: t.__setitem__("transformer_blocks.0.attn.to_out.0.alpha", torch.tensor(2.0)))
    torch.testing.assert_close(delta(), 0.5 * product, rtol=0, atol=1e-6)  # alpha 2 / rank 4
    rewrite(path, lambda t, m: t.__setitem__("transformer_blocks.0.attn.to_out.0.alpha", torch.tensor(-1.0)))
    with pytest.raises(AdapterError, match="alpha.*positive"):
        read_adapter(path, base_model=fasth3.TINY_BASE_MODEL)


@pytest.mark.parametrize("spelling", ["peft", "kohya"])
def test_peft_and_kohya_spellings_fuse_the_same(tmp_path, spelling):
    path = write_synthetic_adapter(tmp_path / "a.safetensors", CFG, seed=8)
    want = load_dit("tiny", plan_student("tiny", TINY, path)).state_dict()

    def respell(tensors, meta):
        for key in list(tensors):
            new = key
            if spelling == "peft":
                new = "base_model.model." + key.replace(".lora_A.weight", ".lora_A.default.weight") \
                    .replace(".lora_B.weight", ".lora_B.default.weight")
            else:
                new = "diffusion_model." + key.replace(".lora_A.", ".lora_down.").replace(".lora_B.", ".lora_up.")
            tensors[new] = tensors.pop(key)
        if spelling == "kohya":  # alpha = rank: scale 1
            tensors["diffusion_model.transformer_blocks.0.attn.to_q.alpha"] = torch.tensor(4.0)
    rewrite(path, respell)
    got = load_dit("tiny", plan_student("tiny", TINY, path)).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_low_rank_pairs_on_unwrapped_modules_are_named(tmp_path):
    path = write_synthetic_adapter(tmp_path / "a.safetensors", CFG, seed=9, rank=4)
    raw = load_file(path)
    assert not any(k.startswith(("proj_in.lora", "time_embedder.")) and ".lora_" in k for k in raw)  # writer

    def add_pairs(tensors, meta):
        tensors["proj_in.lora_A.weight"] = torch.zeros(4, CFG.video_patch_dim)
        tensors["proj_in.lora_B.weight"] = torch.zeros(CFG.hidden_size, 4)
        tensors["time_embedder.linear_1.lora_A.weight"] = torch.zeros(4, CFG.freq_dim)
        tensors["time_embedder.linear_1.lora_B.weight"] = torch.zeros(CFG.time_embed_hidden_dim, 4)
        meta["low_rank_tensors"] = str(int(meta["low_rank_tensors"]) + 4)
    rewrite(path, add_pairs)
    with pytest.raises(AdapterError, match="never wraps.*proj_in, time_embedder.linear_1"):
        read_adapter(path, base_model=fasth3.TINY_BASE_MODEL)


@pytest.mark.parametrize("stated, outcome", [("", "warning"), ("/models/MiniMax-H3", "warning"),
                                             ("./h3", "warning"), ("Other/Model", "error")])
def test_base_model_policy(tmp_path, stated, outcome):
    path = write_synthetic_adapter(tmp_path / "a.safetensors", CFG, seed=1, base_model=stated)
    if outcome == "error":
        with pytest.raises(AdapterError, match="base_model='Other/Model'"):
            read_adapter(path, base_model=fasth3.TINY_BASE_MODEL)
    else:
        assert any("base_model" in w for w in read_adapter(path, base_model=fasth3.TINY_BASE_MODEL).warnings)


def test_position_sets_on_adapters_and_contracts(tmp_path, bundle):
    plan = plan_student("tiny", TINY, bundle, variant="vsa-datafree", positions="fastvideo-example")
    assert plan.schedule.positions == (1.0, 0.75, 0.5, 0.25, 0.0)
    assert plan.sidecar["source"] == "named set 'fastvideo-example'"
    assert plan.sidecar["positions_set"] == "fastvideo-example"
    ckpt = write_synthetic_full_student(tmp_path / "v2", "v2", seed=4)
    # V2 (8 forwards): FastVideo's example rule at 9 grid points, linspace(1, 0, 9), at the contract's shifts 10 / 3.
    v2 = plan_student(str(ckpt), read_checkpoint_info(ckpt), positions="fastvideo-example").schedule
    assert v2.positions == pytest.approx([1 - i / 8 for i in range(9)]) and v2.video_shift == 10.0
    assert v2.source == "named set 'fastvideo-example' (linspace(1, 0, 9): 8 forwards)"
    with pytest.raises(ValueError, match="drives 4 forwards but .* states 8"):
        plan_student(str(ckpt), read_checkpoint_info(ckpt), positions="release")
    ckpt = write_synthetic_full_student(tmp_path / "v1", "v1-vsa-datafree", seed=4)
    v1 = plan_student(str(ckpt), read_checkpoint_info(ckpt), positions="fastvideo-example").schedule
    assert v1.positions[0] == 1.0 and v1.video_shift == 12.0  # the v1 contract states no shift: the checkpoint's


# ---------------------------------------------------------------------------------------------- end to end


def test_vsa_student_renders_through_prompt_and_batch(tmp_path, bundle):
    """A tiny VSA student (bundle variant with gates) through `h3render prompt` and `h3render batch` (CPU: the VSA
    torch reference); the sidecar records the attention, its sources, k at the job's shape, and the positions."""
    from tests._cli import run_here

    out = tmp_path / "p.mp4"
    r = run_here("prompt", "Rain on a tin roof", "-o", str(out), "--mode", "fasth3", "--adapter", str(bundle),
                 "--adapter-variant", "vsa-datafree", "--fasth3-positions", "fastvideo-example", "--frames", "22")
    assert r.returncode == 0, r.stderr
    side = json.loads(out.with_suffix(".json").read_text())
    fast = side["extra"]["fasth3"]
    assert fast["variant"] == "vsa-datafree" and fast["attention"]["mode"] == "vsa"
    assert fast["attention"]["sparsity"] == 0.9 and fast["attention"]["tile"] == 64
    w, h = side["job"]["width"], side["job"]["height"]
    # (5n+2 = 7 latent frames) x (h/32) x (w/32) patched grid in 4x4x4 tiles; k = ceil(0.1 V)
    v = -(-7 // 4) * -(-(h // 32) // 4) * -(-(w // 32) // 4)
    assert fast["attention"]["k"][f"{w}x{h}x22"] == {"video_tiles": v, "k": max(1, -(-v // 10))}
    assert side["sigmas"]["source"] == "named set 'fastvideo-example'" and side["sigmas"]["positions"][0] == 1.0

    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text(json.dumps({"id": "a", "prompt": "A bell tolls", "mode": "fasth3", "frames": 22}) + "\n")
    r = run_here("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--adapter",
                 str(bundle / "vsa-synthetic-step1900"), "--quiet")
    assert r.returncode == 0, r.stderr
    sidecars = list((tmp_path / "out").glob("*.json"))
    job = next(json.loads(p.read_text()) for p in sidecars if "extra" in json.loads(p.read_text()))
    assert job["extra"]["fasth3"]["attention"]["mode"] == "vsa"
    assert job["extra"]["fasth3"]["layout"] == "variant folder" and job["sigmas"]["source"] == "release default"


def _student_forward(adapter, ctx=None):
    from tests.unit.test_vsa_dit import _inputs, _tables

    dit = load_dit("tiny", plan_student("tiny", TINY, adapter))
    assert dit.vsa_sparsity == 0.9
    layout, video, audio, text = _inputs()
    tables, index = _tables(dit, layout)
    with torch.no_grad():
        if ctx is None:
            return dit(video, audio, text, layout, tables, index)
        from h3render.models.attention import sdpa_attention
        from h3render.parallel.dit import sharded_forward

        return sharded_forward(dit, ctx, video, audio, text, layout, tables, index, dit.rope_tables(layout.positions),
                               base_attention=sdpa_attention)


def _ulysses_worker(rank, port, adapter, queue):
    with cpu_rank(rank, port, 2) as ctx:
        v, a = _student_forward(adapter, ctx)
        if rank == 0:
            put_result(queue, (v.clone(), a.clone()))


def test_loaded_vsa_student_on_two_ulysses_ranks_equals_one(tmp_path):
    """The student's gates loaded through the hook; Ulysses (gloo, 2 ranks: heads split, whole tiles) = 1 rank."""
    from tests._numerics import rel_err

    adapter = str(write_synthetic_adapter(tmp_path / "v.safetensors", CFG, seed=12, with_set_weight=True))
    [(v, a)] = run_ranks(_ulysses_worker, 2, (adapter,), results=1)
    ref_v, ref_a = _student_forward(adapter)
    assert rel_err(v, ref_v) <= 1e-5 and rel_err(a, ref_a) <= 1e-5


# ---------------------------------------------------------------------------------------------- make-checkpoint


def test_make_checkpoint_writes_every_published_student_kind(tmp_path):
    """`h3render make-checkpoint` wrote a dense adapter only (issue #28 item 7): `--adapter-kind vsa` writes the gate
    of every DiT block, `--adapter-bundle` the v1 LoRA bundle, `--student NAME` a full v1 / V2 checkpoint. Each
    loads as its kind: VSA on with the written gates in every block, or dense."""
    from h3render.checkpoint.students import BUNDLE_VARIANTS, read_student
    from tests._cli import invoke, one_error_line, run_here

    base, vsa, bundle = tmp_path / "base", tmp_path / "vsa.safetensors", tmp_path / "bundle"
    r = run_here("make-checkpoint", str(base), "--adapter", str(vsa), "--adapter-kind", "vsa",
                 "--adapter-bundle", str(bundle))
    assert r.returncode == 0, r.stderr
    assert "synthetic vsa FastH3 adapter" in r.stderr and "v1 LoRA bundle" in r.stderr
    info = read_checkpoint_info(base)
    plan = plan_student(str(base), info, vsa)
    assert plan.attention.vsa and read_adapter(vsa, fasth3.TINY_BASE_MODEL).gate_blocks == tuple(range(CFG.num_layers))
    dit = load_dit(base, plan)
    for i in range(CFG.num_layers):
        torch.testing.assert_close(dit.blocks[i].attn.gate_proj.weight, gate_of(vsa, i).float(), rtol=0, atol=0)
    for variant in BUNDLE_VARIANTS:
        parts = read_student(str(base), info, str(bundle), variant=variant)
        assert parts.attention.vsa == variant.startswith("vsa-"), variant

    # One full student through the CLI (the writer's every student and layout: test_full_checkpoints_load_their_gates).
    out = tmp_path / "v2"
    r = run_here("make-checkpoint", str(out), "--layout", "official", "--student", "v2")
    assert r.returncode == 0 and "--mode fasth3" in r.stderr, r.stderr
    plan = plan_student(str(out), read_checkpoint_info(out))
    assert plan.attention.mode == "vsa" and plan.sidecar["model_id"].startswith("FastVideo/")
    dit = load_dit(out, plan)
    assert all(bool(dit.blocks[i].attn.gate_proj.weight.any()) for i in range(CFG.num_layers))

    # Mistakes are one line, exit 2, before anything is written.
    assert "--adapter-kind needs --adapter" in one_error_line(invoke("make-checkpoint", str(tmp_path / "n1"),
                                                                      "--adapter-kind", "vsa"))
    assert "checkpoint folder" in one_error_line(invoke("make-checkpoint", str(tmp_path / "n2.safetensors"),
                                                        "--layout", "single-file", "--student", "v2"))
    assert "takes no adapter" in one_error_line(invoke("make-checkpoint", str(tmp_path / "n3"), "--student", "v2",
                                                       "--adapter", str(tmp_path / "n3.safetensors")))
    assert "already exists" in one_error_line(invoke("make-checkpoint", str(tmp_path / "n4"), "--adapter", str(vsa)))
    assert "not empty" in one_error_line(invoke("make-checkpoint", str(tmp_path / "n5"), "--adapter-bundle",
                                                str(bundle)))
    assert not any((tmp_path / f"n{i}").exists() for i in range(1, 6))
    assert "--adapter-kind" in invoke("make-checkpoint", "--help").output
    from h3render.cli import make_checkpoint_command
    from h3render.make_checkpoint.synthetic_adapter import FULL_STUDENTS

    # The torch-free CLI spells the students out: they must be the writer's.
    (option,) = [p for p in make_checkpoint_command.params if p.name == "student"]
    assert list(option.type.choices) == list(FULL_STUDENTS)
def test_vsa_sparsity_override(tmp_path, bundle):
    """V2's own sparsity is 0.8 (its contract); --vsa-sparsity replaces it and says so; a dense student or no
    student refuses it (issue #25 item 4)."""
    ckpt = write_synthetic_full_student(tmp_path / "v2", "v2", seed=4)
    info = read_checkpoint_info(ckpt)
    own = plan_student(str(ckpt), info).attention
    assert own.sparsity == 0.8 and own.sparsity_source != "--vsa-sparsity"
    set_ = plan_student(str(ckpt), info, sparsity=0.5)
    assert set_.attention.sparsity == 0.5 and set_.sidecar["attention"]["sparsity_source"] == "--vsa-sparsity"
    with pytest.raises(ValueError, match="the student is dense"):
        plan_student("tiny", TINY, bundle, variant="dense-datafree", sparsity=0.5)
    with pytest.raises(ValueError, match="needs a VSA FastH3 student"):
        plan_student("tiny", TINY, sparsity=0.5)


def test_fasth3_trim_layout_loads_and_builds_its_factorized_adaln(tmp_path):
    """FastH3 Trim's published layout (FastVideo 0.2.1 `adaln_rank`; fasth3-rtx blog): fewer blocks, renumbered, and
    every AdaLN projection reading the shared basis `adaln_basis(silu(temb))` without a SiLU of its own. The tables
    equal that math on the file's own tensors; a bf16 load keeps the factorized AdaLN in float16, as FastVideo."""
    import torch.nn.functional as F

    from h3render.make_checkpoint.synthetic_trim import write_synthetic_trim
    from h3render.models.dit import timestep_sinusoid

    root = write_synthetic_trim(tmp_path / "trim", seed=3, keep=(1,), rank=4)
    info = read_checkpoint_info(str(root))
    assert info.release.dit.num_layers == 1 and info.release.dit.adaln_rank == 4
    plan = plan_student(str(root), info)
    dit = load_dit(str(root), plan)
    files = load_file(str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    t = torch.tensor([0.25, 0.75])
    tables = dit.modulation_tables(t)
    temb = dit.time_embedder(timestep_sinusoid(t, dit.cfg.freq_dim))
    basis = F.silu(temb) @ files["adaln_basis.weight"].float().T  # [K, r]
    block = basis @ files["transformer_blocks.0.adaln_proj.linear.weight"].float().T + \
        files["transformer_blocks.0.adaln_proj.linear.bias"].float()
    final = basis @ files["norm_out.linear.weight"].float().T + files["norm_out.linear.bias"].float()
    assert torch.allclose(tables.blocks[0].reshape(2, -1), block, atol=1e-6)
    assert torch.allclose(tables.final.reshape(2, -1), final, atol=1e-6)
    # The kept block 1 became block 0, with its own gate.
    assert torch.equal(dit.blocks[0].attn.gate_proj.weight, files["transformer_blocks.0.attn.to_gate_compress.weight"]
                       .float())
    bf16 = load_components(str(root), "cpu", torch.bfloat16, parts=("dit",), tensor_hook=plan.hook).dit
    assert bf16.adaln_basis.weight.dtype == torch.float16 and bf16.blocks[0].adaln_proj.linear.weight.dtype == \
        torch.float16 and bf16.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
