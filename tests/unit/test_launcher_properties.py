"""Property tests of the launcher environments (issue #28 item 10): SLURM array variables over their whole range
(both ends, bit boundaries, every spelling), `--shard i/n`, and torchrun / srun rank variables with and without a
rendezvous address. Each input either gives the right value or a ValueError naming the variable (one line): the CLI
turns it into exit 2 before anything loads."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from h3render.parallel.groups import launcher_env
from h3render.parallel.launch import check_rendezvous, plan_world
from h3render.shards import parse_shard, shard_from_slurm, shard_jobs

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EDGES = st.sampled_from([0, 1, 2, 2**7 - 1, 2**8, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64])
INTS = st.one_of(EDGES, st.integers(min_value=0, max_value=2**64))
# Spellings int() takes that SLURM never writes, and text that is no number at all.
NOT_PLAIN = st.one_of(st.sampled_from(["", " ", "+3", "-1", "1_0", "3.0", "0x10", "1e3", "٣", "３", "\u00b2", "3\n",
                                       "\udcff", "inf", "nan"]),
                      st.text(min_size=1, max_size=6).filter(lambda t: not (t.isascii() and t.isdigit())))


@FAST
@given(low=INTS, step=st.integers(1, 2**20), count=st.integers(1, 2**31), data=st.data())
def test_every_evenly_spaced_array_task_gets_its_shard(low, step, count, data):
    k = data.draw(st.integers(0, count - 1))
    env = {"SLURM_ARRAY_TASK_ID": str(low + k * step), "SLURM_ARRAY_TASK_MIN": str(low),
           "SLURM_ARRAY_TASK_STEP": str(step), "SLURM_ARRAY_TASK_COUNT": str(count)}
    assert shard_from_slurm(env) == (k, count)


@FAST
@given(low=INTS, step=st.integers(1, 1000), count=st.integers(1, 1000), off=st.integers(1, 10**6))
def test_a_task_outside_the_range_or_between_steps_is_refused(low, step, count, off):
    for task in {low + count * step + off - 1, low + off * step + (1 if step > 1 else count * step)}:
        if task >= low and (task - low) % step == 0 and (task - low) // step < count:
            continue
        env = {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(low),
               "SLURM_ARRAY_TASK_STEP": str(step), "SLURM_ARRAY_TASK_COUNT": str(count)}
        with pytest.raises(ValueError, match="pass --shard i/n"):
            shard_from_slurm(env)


@FAST
@given(name=st.sampled_from(["ID", "COUNT", "MIN", "STEP"]), raw=NOT_PLAIN)
def test_a_slurm_variable_that_is_not_a_plain_integer_is_named(name, raw):
    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_STEP": "1",
           "SLURM_ARRAY_TASK_COUNT": "4", f"SLURM_ARRAY_TASK_{name}": raw}
    if name == "ID" and raw == "":
        assert shard_from_slurm(env) is None  # an empty ID: not an array task
        return
    with pytest.raises(ValueError) as info:
        shard_from_slurm(env)
    assert f"SLURM_ARRAY_TASK_{name}" in str(info.value) and "\n" not in str(info.value)


def test_no_array_variables_is_no_shard_and_a_missing_count_is_named():
    assert shard_from_slurm({}) is None
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_COUNT is not"):
        shard_from_slurm({"SLURM_ARRAY_TASK_ID": "0"})


@FAST
@given(count=st.one_of(EDGES.filter(lambda n: n >= 1), st.integers(1, 2**64)), data=st.data())
def test_parse_shard_round_trips_and_shards_cover_every_job_once(count, data):
    index = data.draw(st.integers(0, count - 1))
    assert parse_shard(f"{index}/{count}") == (index, count)
    assert parse_shard(f" {index} / {count} ") == (index, count)
    small = min(count, 7)
    jobs = list(range(data.draw(st.integers(0, 40))))
    assert sorted(j for i in range(small) for j in shard_jobs(jobs, i, small)) == jobs


@FAST
@given(text=st.one_of(st.sampled_from(["٠/٤", "０/４", "1/1", "2/2", "-1/4", "1/0", "a/b", "1/", "/4", "1//4",
                                       "\udcff/4"]), st.text(max_size=8)))
def test_parse_shard_refuses_anything_but_an_ascii_index_below_its_count(text):
    try:
        index, count = parse_shard(text)
    except ValueError as exc:
        assert "--shard" in str(exc) or "shard" in str(exc)
        return
    assert text.strip().replace(" ", "").isascii() and 0 <= index < count


RANK_VALUES = st.one_of(st.integers(0, 2**63).map(str), NOT_PLAIN)
OPTIONAL = lambda values: st.one_of(st.none(), values)  # noqa: E731


@FAST
@given(torchrun=st.fixed_dictionaries({"RANK": OPTIONAL(RANK_VALUES), "WORLD_SIZE": OPTIONAL(RANK_VALUES),
                                       "LOCAL_RANK": OPTIONAL(RANK_VALUES)}),
       srun=st.fixed_dictionaries({"SLURM_PROCID": OPTIONAL(RANK_VALUES), "SLURM_NTASKS": OPTIONAL(RANK_VALUES),
                                   "SLURM_LOCALID": OPTIONAL(RANK_VALUES)}),
       rendezvous=st.fixed_dictionaries({"MASTER_ADDR": OPTIONAL(st.sampled_from(["127.0.0.1", "node-1", "", " "])),
                                         "MASTER_PORT": OPTIONAL(st.sampled_from(
                                             ["29500", "1", "65535", "0", "65536", "", "x", "٣"]))}))
def test_every_launcher_environment_gives_ranks_or_a_named_error(torchrun, srun, rendezvous):
    env = {k: v for k, v in {**torchrun, **srun, **rendezvous}.items() if v is not None}
    try:
        rank, world, local = launcher_env(env)
    except ValueError as exc:
        assert any(name in str(exc) for name in env) or "outside world size" in str(exc), str(exc)
        return
    assert 0 <= rank < world and local >= 0
    if world == 1:
        assert (rank, world, local) == (0, 1, 0)
        return
    try:
        assert plan_world(None, "cpu", 56, env=env) == (1, None)  # launched ranks: nothing to spawn
    except ValueError as exc:
        assert "MASTER_ADDR" in str(exc) or "MASTER_PORT" in str(exc)
        assert not env.get("MASTER_ADDR", "").strip() or env.get("MASTER_PORT") not in [str(p) for p in (1, 29500,
                                                                                                     65535)]
        return
    assert env["MASTER_ADDR"].strip() and 1 <= int(env["MASTER_PORT"]) <= 65535


def test_srun_without_a_rendezvous_address_is_refused_before_anything_loads():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        plan_world(None, None, 56, env=env)
    with pytest.raises(ValueError, match="MASTER_PORT='0' is not a TCP port"):
        check_rendezvous({"MASTER_ADDR": "node-1", "MASTER_PORT": "0"})
    with pytest.raises(ValueError, match="MASTER_PORT=''"):
        plan_world(None, None, 56, env={**env, "MASTER_ADDR": "node-1"})
    assert plan_world(None, None, 56, env={**env, "MASTER_ADDR": "node-1", "MASTER_PORT": "29500"}) == (1, None)
    assert plan_world(None, "cpu", 56, env={"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (1, None)  # one task


def test_a_malformed_srun_task_count_names_the_variable():
    with pytest.raises(ValueError, match="SLURM_NTASKS='x'"):
        launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"})


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("launcher")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variable=st.sampled_from(["RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"]),
       raw=NOT_PLAIN.filter(lambda t: "\x00" not in t), command=st.sampled_from(["prompt", "batch"]))
def test_a_malformed_launcher_variable_is_one_line_exit_2_on_the_command(out_dir, variable, raw, command):
    """The tiny model's notice went through the CLI's `say`, which called `launcher_env` outside the usage-error
    handling: RANK=x printed a ValueError traceback (exit 1). Now every malformed rank variable is one line, exit 2,
    before anything loads."""
    from tests._cli import invoke, one_error_line

    torchrun = variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    # Every launcher and rendezvous variable stated (None: unset), so nothing the worker's environment holds can make
    # a malformed case a well-formed 2-rank launch, which waits for its second rank (a CI run hung there once).
    env: dict = {name: None for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                                         "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"RANK": "0", "WORLD_SIZE": "2"} if torchrun else {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    env[variable] = raw
    if command == "prompt":
        args = ("prompt", "x", "-o", str(out_dir / "x.mp4"))
    else:
        manifest = out_dir / "m.jsonl"
        manifest.write_text('{"prompt": "x", "output": "x"}\n')
        args = ("batch", str(manifest), "--out-dir", str(out_dir / "out"))
    line = one_error_line(invoke(*args, env=env))
    assert variable in line or "outside world size" in line or "MASTER_ADDR" in line, line
    assert not list(out_dir.glob("**/*.mp4"))
