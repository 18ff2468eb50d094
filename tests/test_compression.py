"""gpudist.compression and GradientCompressionOptimizer: compressed collectives against the plain ones, error feedback
conservation, parity with DDP when nothing is dropped, accounting, checkpoints across world sizes.

Tolerances come from rounding-error bounds (tests/tolerances.py): an fp32 average of N values, in any order and
whether summed then divided or pre-scaled by a rounded 1/N, is within ``average_rtol(N)`` of the exact mean,
relative to the mean of the magnitudes; error feedback's conservation is exact but for the fp32 roundings of each
step, bounded in :func:`conservation` (tests/helpers.py). Training parity is against single-process training in
float64, within a multiple of the float32 run's own error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist import (
    DDPModel,
    DDPOptimizer,
    GradientCompressionOptimizer,
    ReductionOperation,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
)
from gpudist.compression import (
    CompressedChannel,
    IdentityCompressor,
    Int8Compressor,
    OneBitCompressor,
    TopKCompressor,
    parse_compressor,
)
from gpudist.testing import run_ranks

from .backends import MPI
from .helpers import (
    LOSSY,
    assert_lossless,
    average_rtol,
    batch,
    conservation,
    flat,
    fresh_net,
    initial_state,
    lossless_vs_plain,
)
from .tolerances import assert_matches_reference, reference_pair

CPU = torch.device("cpu")
# ------------------------------------------------------------------------------------------------------ compressors


def test_wire_formats_meet_the_byte_targets():
    """Catches a compressor whose payload (scales and indices included) is larger than the issue's targets: top-k 1%
    <= 2.5%, int8 <= 27%, 1-bit <= 4% of dense fp32, or whose declared size disagrees with what it really sends."""
    n = 1 << 20
    dense = 4 * n
    assert TopKCompressor(0.01).payload_bytes(n) / dense <= 0.025
    assert Int8Compressor().payload_bytes(n) / dense <= 0.27
    assert OneBitCompressor().payload_bytes(n) / dense <= 0.04
    assert IdentityCompressor().payload_bytes(n) == dense
    # The declared size is what the codes weigh.
    x = torch.randn(4096)
    for codec in (Int8Compressor(), OneBitCompressor(), IdentityCompressor()):
        codes = codec.encode(x, None, seed=0)
        assert sum(c.numel() * c.element_size() for c in codes) == codec.payload_bytes(4096)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("topk:0.01", TopKCompressor),
        ("topk:0.5:threshold", TopKCompressor),
        ("int8", Int8Compressor),
        ("int8:128", Int8Compressor),
        ("1bit", OneBitCompressor),
        ("1bit:512", OneBitCompressor),
        ("none", IdentityCompressor),
    ],
)
def test_parse_compressor(spec, expected):
    """Catches a command-line spec that builds the wrong compressor or drops its argument."""
    c = parse_compressor(spec)
    assert type(c) is expected
    if spec == "int8:128":
        assert c.block_size == 128
    if spec == "topk:0.5:threshold":
        assert (c.ratio, c.mode) == (0.5, "threshold")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("topk", "not one of"),
        ("topk:0", "ratio=0"),
        ("topk:2", "ratio=2"),
        ("int8:100", "power of two"),
        ("gzip", "not one of"),
        ("topk:0.1:fast", "mode"),
    ],
)
def test_bad_compressor_specs_name_the_value(spec, match):
    """Catches a bad spec that is accepted silently or fails with an error that does not say what is wrong."""
    with pytest.raises(ValueError, match=match):
        parse_compressor(spec)


# ------------------------------------------------------------------------------------------------------ collectives


WORLDS = [
    ("inmemory", 2),
    ("inmemory", 3),
    ("inmemory", 4),
    ("gloo", 2),
    ("gloo", 3),
    pytest.param(MPI.values[0], 2, marks=(*MPI.marks, pytest.mark.slow), id="mpi-2"),  # slow tier
]


@pytest.mark.parametrize(("backend", "world"), WORLDS)
@pytest.mark.parametrize("compressor", [IdentityCompressor(), TopKCompressor(1.0)], ids=["two-phase", "sparse"])
def test_lossless_compressed_collectives_equal_the_plain_ones(backend, world, compressor):
    """Compression turned off (fp32 codes through the two-phase all-reduce; top-k with k = n through the sparse
    all-gather): the result must equal the plain all-reduce / reduce-scatter. Catches chunks sent to the wrong rank,
    padding that leaks into the result, uneven ranges (1001 and 7 elements over 3-4 ranks) cut wrongly, a missing or
    doubled 1/N, and top-k sets that are summed on the wire instead of scatter-added."""
    for n in (1001, 7):
        for results in run_ranks(lossless_vs_plain, world, backend, compressor=compressor, n=n):
            assert_lossless(results, world)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", list(LOSSY))
@pytest.mark.parametrize("scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_error_feedback_conserves_the_gradient_sum(world, name, scatter):
    """Error feedback loses nothing: after 12 steps, the sum of the applied (averaged) updates plus what is still
    pending (mean of the worker residuals, plus the server residual) equals the sum of the true averaged gradients.
    Catches a residual not updated in place, the server residual missing from phase 2, a residual kept for padding,
    and a residual on the wrong scale (per-rank sums vs averages). The compressed results also really differ from
    the plain ones (the test is not passing because nothing was compressed)."""
    for applied, pending, true, bound in run_ranks(
        conservation, world, "inmemory", compressor=LOSSY[name], n=1000, scatter=scatter
    ):
        torch.testing.assert_close(applied + pending, true, rtol=0, atol=bound)
        assert float((applied - true).abs().max()) > 1e-3


def test_without_error_feedback_the_loss_is_not_kept():
    """``error_feedback=False`` keeps no residual (and then the applied sum drifts from the true one)."""

    def rank(comm):
        channel = CompressedChannel(comm, TopKCompressor(0.1), 100, device=CPU, error_feedback=False)
        g = torch.arange(100, dtype=torch.float32) * (comm.rank + 1)
        channel.all_reduce(g)
        return channel.worker_residual(), int((g != 0).sum())

    for residual, nonzero in run_ranks(rank, 2, "inmemory"):
        assert residual is None and nonzero <= 20


def test_channel_rejects_a_buffer_of_another_size():
    """Catches a hook called with a buffer that is not the one its residual was sized for (silent misalignment)."""

    def rank(comm):
        channel = CompressedChannel(comm, Int8Compressor(), 100, device=CPU)
        with pytest.raises(ValueError, match="flat tensor of 100 elements"):
            channel.all_reduce(torch.zeros(99))
        return True

    assert all(run_ranks(rank, 2, "inmemory"))


# ------------------------------------------------------------------------------------------------------- optimizer

PAIRINGS = {
    "plain": (None, DDPOptimizer),
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "zero1-plain": (None, ZeRO1Optimizer),
    "zero2-plain": (None, ZeRO2Optimizer),
}
SETUPS = list(PAIRINGS)


def build(comm, state, setup, compressor=None, error_feedback=True, warmup_steps=0, config_kw=None):
    """One of the supported pairings, uncompressed (compressor None) or wrapped in a GradientCompressionOptimizer.
    ``"<pairing>-momentum"``: momentum SGD (two param groups, one with weight decay) and ``compress="momentum"``."""
    config = ShardingConfiguration(comm, **({"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.00002} | (config_kw or {})))
    net = fresh_net(state)
    pairing = setup.removesuffix("-momentum")
    model_cls, opt_cls = PAIRINGS[pairing]
    model = model_cls(net, config) if model_cls is not None else net
    if setup.endswith("-momentum"):
        params = list(model.parameters())
        torch_opt = torch.optim.SGD(
            [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "lr": 0.02}], lr=0.05, momentum=0.9
        )
    else:
        torch_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = opt_cls(torch_opt, config)
    if compressor is not None:
        opt = GradientCompressionOptimizer(
            opt,
            config,
            compressor,
            warmup_steps=warmup_steps,
            error_feedback=error_feedback,
            compress="momentum" if setup.endswith("-momentum") else "gradients",
        )
    return net, model, opt


def single_process(state, setup, steps=6, dtype=torch.float32) -> torch.Tensor:
    """:func:`train`'s optimizer and schedule on one process over the global batch (``setup`` picks Adam, or the
    momentum SGD of the ``-momentum`` setups)."""
    net = fresh_net(state).to(dtype)
    params = list(net.parameters())
    if setup.endswith("-momentum"):
        opt = torch.optim.SGD(
            [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "lr": 0.02}], lr=0.05, momentum=0.9
        )
    else:
        opt = torch.optim.Adam(params, lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for step in range(steps):
        x, y = batch(step)
        F.mse_loss(net(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return flat(net)


def train(comm, state=None, setup="ddp", compressor=None, steps=6, **kw):
    net, model, opt = build(comm, state, setup, compressor, **kw)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))  # lr read afresh every step
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return flat(net)


@pytest.mark.parametrize(("backend", "world"), [("inmemory", 2), ("inmemory", 3), ("gloo", 2)])
@pytest.mark.parametrize("setup", SETUPS)
def test_topk_with_k_equal_n_matches_uncompressed_training(backend, world, setup):
    """Top-k with k = n sends everything: training must equal the same setup uncompressed (DDP / ZeRO-1 / ZeRO-2,
    with their model wrappers or a plain module) after 6 Adam steps, both single-process training. Catches the
    hook not installed (gradients never averaged: replicas drift), installed twice (averaged twice), a ZeRO-2 piece
    taken from the wrong range, and the optimizer stepping before the compressed gradients arrived. Lossy compressors
    must keep every replica identical too (everyone applies the same decoded average)."""
    state = initial_state()
    reference = run_ranks(train, world, backend, state=state, setup=setup)[0]
    exact = run_ranks(train, world, backend, state=state, setup=setup, compressor="topk:1.0")
    # Not bit for bit: the uncompressed paths scale by a rounded 1/N before they sum (DDP folds it into its bucket
    # copy), top-k divides its scattered sum by N. Both are single-process training up to summation order.
    expected = reference_pair(single_process, state, setup)
    assert_matches_reference(reference, *expected, what="uncompressed")
    for params in exact:
        assert_matches_reference(params, *expected, what="top-k with k = n")
    for spec in ("int8", "1bit", "topk:0.1"):
        replicas = run_ranks(train, world, backend, state=state, setup=setup, compressor=spec)
        assert all(torch.equal(p, replicas[0]) for p in replicas), spec
        assert not torch.equal(replicas[0], reference)


@pytest.mark.parametrize(("backend", "world"), [("inmemory", 2), ("inmemory", 3), ("gloo", 2)])
@pytest.mark.parametrize("setup", ["ddp", "plain"])
@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_momentum_compression_uncompressed_is_momentum_sgd(backend, world, setup, warmup_steps):
    """compress="momentum" with a lossless codec (fp32 two-phase, and top-k with k = n) equals DDP with
    torch.optim.SGD(momentum=0.9) after 6 steps: two param groups (one with weight decay), a decaying lr, with and
    without dense warm-up steps. Catches the momentum buffer not kept in the torch optimizer's state (lost at the
    hand-over from warm-up), gradients still averaged in backward, a missing weight decay or momentum factor, and a
    stale lr. (Averaging moves from the gradient to the momentum: fp32 rounding differs, so both are compared with
    single-process momentum SGD in float64.) 1-bit keeps replicas identical."""
    state = initial_state()
    reference = run_ranks(train, world, backend, state=state, setup=f"{setup}-momentum")[0]
    expected = reference_pair(single_process, state, f"{setup}-momentum")
    assert_matches_reference(reference, *expected, what="uncompressed")
    for spec in ("none", "topk:1.0"):
        for params in run_ranks(
            train, world, backend, state=state, setup=f"{setup}-momentum", compressor=spec, warmup_steps=warmup_steps
        ):
            assert_matches_reference(params, *expected, what=spec)
    replicas = run_ranks(
        train, world, backend, state=state, setup=f"{setup}-momentum", compressor="1bit", warmup_steps=warmup_steps
    )
    assert all(torch.equal(p, replicas[0]) for p in replicas)
    assert not torch.equal(replicas[0], reference)


def accounting(comm, warmup_steps=2):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))  # 33k parameters: padding is negligible
    torch.manual_seed(1 + comm.rank)
    config = ShardingConfiguration(comm)
    model = DDPModel(net, config)
    opt = GradientCompressionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), config, "int8", warmup_steps=warmup_steps
    )
    reports = []
    for _ in range(4):
        before = comm.stats.bytes_of("all_to_all")
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        meta = model.get_model_metadata()["compression"]
        reports.append((meta["compressing"], meta["last_step"]["ratio"], comm.stats.bytes_of("all_to_all") - before))
    return reports, opt.communication_report()


def test_warmup_then_compression_with_byte_accounting():
    """The first ``warmup_steps`` steps are dense (ratio 1, no all-to-all), then int8 sends <= 27% of the dense bytes,
    and get_model_metadata() reports it. Catches warm-up that never ends or never happens, and accounting that counts
    the dense equivalent as sent."""
    for reports, report in run_ranks(accounting, 2, "inmemory"):
        assert [r[0] for r in reports] == [False, True, True, True]  # whether the *next* step compresses
        assert reports[0][1] == reports[1][1] == 1.0 and reports[0][2] == reports[1][2] == 0
        assert 0.25 <= reports[2][1] <= 0.27 and reports[3][2] > 0
        assert report["steps"] == 4 and report["total"]["sent_bytes"] < report["total"]["dense_bytes"]


def test_bad_pairings_and_arguments_are_refused():
    """Each unsupported pairing or bad argument fails at construction with an error naming it, before any step."""

    def rank(comm):
        state = initial_state()
        config = ShardingConfiguration(comm)
        errors = []

        def sgd(module):
            return torch.optim.SGD(module.parameters(), lr=0.1)

        def wrapped(model_cls):
            # The model is held while the optimizer looks it up: a configuration knows its models only weakly, so a
            # temporary wrapper could be collected first (then the optimizer would see a plain module).
            model = model_cls(fresh_net(state), config)
            return GradientCompressionOptimizer(sgd(model), config, "int8")

        cases = [
            lambda: wrapped(ZeRO3Model),
            lambda: wrapped(ZeRO2Model),
            lambda: GradientCompressionOptimizer(sgd(fresh_net(state)), config, "int8", warmup_steps=-1),
            lambda: GradientCompressionOptimizer(sgd(fresh_net(state)), config, "zip"),
            lambda: GradientCompressionOptimizer(sgd(fresh_net(state)), config, "1bit", compress="weights"),
            lambda: GradientCompressionOptimizer(
                torch.optim.Adam(fresh_net(state).parameters()), config, "1bit", compress="momentum"
            ),
            lambda: GradientCompressionOptimizer(
                ZeRO1Optimizer(sgd(fresh_net(state)), config), config, "1bit", compress="momentum"
            ),
            lambda: GradientCompressionOptimizer(
                torch.optim.SGD(fresh_net(state).parameters(), lr=0.1, momentum=0.9, nesterov=True),
                config,
                "1bit",
                compress="momentum",
            ),
            lambda: GradientCompressionOptimizer(sgd(fresh_net(state)), config, "1bit", compress="momentum"),
        ]
        for case in cases:
            with pytest.raises((TypeError, ValueError)) as info:
                case()
            errors.append(str(info.value))
        return errors

    errors = run_ranks(rank, 2, "inmemory")[0]
    assert "ZeRO3Model is not supported" in errors[0]
    assert "ZeRO2Model pairs with a ZeRO2Optimizer" in errors[1]
    assert "warmup_steps=-1" in errors[2]
    assert "'zip'" in errors[3]
    assert "compress='weights'" in errors[4]
    assert "runs momentum SGD (torch.optim.SGD), got Adam" in errors[5]
    assert "ZeRO1Optimizer shards" in errors[6]
    assert "nesterov=True" in errors[7] and "momentum=0" in errors[8]


# ------------------------------------------------------------------------------------------------------ checkpoints


def residuals_by_name(opt, comm, net):
    """Worker residual (this rank's) and the full server residual (gathered), per parameter name."""
    names = {id(p): n for n, p in net.named_parameters()}
    worker, server = {}, {}
    for key, channel in opt.hook.channels.items():
        w, held = channel.worker_residual(), channel.server_residual()
        for pos, n, p, at in opt.hook.buffers[key].spans:
            name = names[id(p)]
            worker.setdefault(name, torch.zeros(p.numel()))[at : at + n] = w[pos : pos + n]
            full = server.setdefault(name, torch.zeros(p.numel()))
            if held is not None:
                start, values = held
                a, b = max(pos, start), min(pos + n, start + values.numel())
                if a < b:
                    full[at + a - pos : at + b - pos] = values[a - start : b - start]
    for values in server.values():
        comm.all_reduce(values, ReductionOperation.SUM)
    return worker, server


def save_at(comm, state=None, path=None, setup="ddp", compressor="int8", steps=4):
    net, model, opt = build(comm, state, setup, compressor)
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    gpudist.save_checkpoint(path, model, opt, step=steps)
    worker, server = residuals_by_name(opt, comm, net)
    magnitude = {name: values.abs() for name, values in worker.items()}
    for values in [*worker.values(), *magnitude.values()]:
        comm.all_reduce(values, ReductionOperation.AVERAGE)  # what another world size must take back
    same_net, _, same = build(comm, state, setup, compressor)
    same.load_state_dict(opt.state_dict())  # same world size: state_dict round trip
    mine = residuals_by_name(opt, comm, net)[0]
    assert all(torch.equal(values, mine[name]) for name, values in residuals_by_name(same, comm, same_net)[0].items())
    return worker, server, opt.hook.steps, magnitude


def load_at(comm, state=None, path=None, setup="ddp", compressor="int8"):
    net, model, opt = build(comm, state, setup, compressor)
    gpudist.load_checkpoint(path, model, opt)
    worker, server = residuals_by_name(opt, comm, net)
    with pytest.raises(ValueError, match="load across world sizes through"):
        other = dict(opt.state_dict())
        other["compression"] = {**other["compression"], "world_size": 4}
        opt.load_state_dict(other)
    other = "gradients" if opt.compress == "momentum" else "momentum"
    with pytest.raises(ValueError, match=f"saved with compress='{other}'"):  # residuals of another quantity
        opt.load_state_dict({**opt.state_dict(), "compression": {**opt.state_dict()["compression"], "compress": other}})
    return worker, server, opt.hook.steps


@pytest.mark.parametrize(
    ("setup", "compressor"), [("ddp", "int8"), ("ddp", "topk:0.1"), ("zero2", "1bit"), ("ddp-momentum", "1bit")]
)
def test_residuals_survive_a_checkpoint_at_another_world_size(tmp_path, setup, compressor):
    """Residuals saved at N=4 and loaded at N=2: every new rank's worker residual is the mean of the 4 saved ones
    (so the pending update, mean over ranks, is unchanged), the server residual is the same full tensor, and the
    step count (warm-up) carries over. Catches residuals left out of checkpoints (DeepSpeed's 1-bit Adam resets
    them), residuals attached to the wrong parameter or offset after resharding, and a same-size state_dict
    round trip that loses them."""
    state = initial_state()
    path = tmp_path / "ckpt"
    saved = run_ranks(save_at, 4, "inmemory", state=state, path=path, setup=setup, compressor=compressor)
    assert any(float(v.abs().max()) > 0 for v in saved[0][0].values())  # something was pending
    for worker, server, steps in run_ranks(
        load_at, 2, "inmemory", state=state, path=path, setup=setup, compressor=compressor
    ):
        assert steps == saved[0][2] == 4
        for name, values in saved[0][0].items():
            # Both are fp32 means of the 4 saved residuals (the loader's sum / 4, the backend's AVERAGE).
            atol = 2 * average_rtol(4) * (1 + average_rtol(4)) * saved[0][3][name]
            assert bool(((worker[name] - values).abs() <= atol).all()), name
        for name, values in saved[0][1].items():
            torch.testing.assert_close(server[name], values, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------ convergence


def example_run(tmp_path, name, **kw):
    """examples/train.py's train() on 2 in-memory ranks, on a smaller TinyLM (about 12 s on 2 cores)."""
    import json

    from examples import train as example

    cfg = example.TrainConfig(
        steps=600,
        global_batch=16,
        log_every=1000,
        d_model=64,
        seq_len=32,
        optimizer="sgd",
        lr=0.03,
        compression_warmup=50,
        out=str(tmp_path / name),
        **kw,
    )
    run_ranks(example.train, 2, "inmemory", cfg=cfg)
    return json.loads((tmp_path / name / "metrics.json").read_text())


@pytest.mark.slow
def test_error_feedback_keeps_training_close_to_uncompressed(tmp_path):
    """The example task (TinyLM, momentum SGD, 600 steps, 2 ranks): top-k 1% (of gradients) and 1-bit (of the
    momentum) with error feedback end within 3% of uncompressed training's loss, and without error feedback
    measurably worse (measured: top-k +1.6% with, +8.5% without; 1-bit +0.3% with, +13% without). Catches
    residuals that are not fed back, fed back with the wrong sign or scale, or reset every step; also checks the
    example's compression report (top-k 2%, 1-bit 3.5% of the dense bytes per step after warm-up). The 3% and
    0.05-nat margins bound training outcomes, not rounding: seeds, data and the in-memory collectives are fixed, so
    hosts differ only in BLAS rounding, whose effect after 600 steps has not been measured across hosts."""
    dense = example_run(tmp_path, "dense")
    for name, kw, ratio in [
        ("topk", {"compression": "topk:0.01"}, 0.025),
        ("1bit", {"compression": "1bit", "compress_momentum": True}, 0.04),
    ]:
        with_ef = example_run(tmp_path, f"{name}-ef", **kw)
        without = example_run(tmp_path, f"{name}-no-ef", error_feedback=False, **kw)
        assert with_ef["final_loss"] <= 1.03 * dense["final_loss"], name
        assert without["final_loss"] >= with_ef["final_loss"] + 0.05, name
        report = with_ef["compression"]
        assert report["steps"] == 600 and report["last_step"]["ratio"] <= ratio, name
        assert with_ef["metadata"]["compression"]["compressor"]["name"] == name
        assert with_ef["replicas_identical"] and without["replicas_identical"]


def test_example_command_line_checks_compression_flags(capsys):
    """``examples/train.py --compression`` refuses a bad spec and ZeRO-3 before starting any rank, naming the flag."""
    from examples import train as example

    for argv, message in [
        (["--compression", "topk:5"], "--compression: "),
        (["--strategy", "zero3", "--compression", "int8"], "works with --strategy ddp, zero1"),
        (["--compression", "1bit", "--compress-momentum"], "--compress-momentum needs"),
    ]:
        with pytest.raises(SystemExit):
            example.parse_args(argv)
        assert message in capsys.readouterr().err
    cfg, _ = example.parse_args(["--compression", "1bit", "--optimizer", "sgd", "--lr", "0.03", "--compress-momentum"])
    assert (cfg.compression, cfg.optimizer, cfg.compress_momentum, cfg.out) == ("1bit", "sgd", True, "runs/ddp-1bit-w2")
