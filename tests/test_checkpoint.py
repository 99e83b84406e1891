"""Checkpoint and resume: bit-identical continuation, epsilon history kept, bad checkpoints refused."""
import io
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastdp
from fastdp import checkpoint
from fastdp.accounting import make_accountant
from fastdp.data import BatchMemoryManager, poisson_loader

N, BATCH, STEPS_PER_EPOCH = 40, 6, 4


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))


def build(sigma=1.0, width=8, seed=None, model_seed=0):
    """Fresh objects; the model's initial weights and the seeds differ from any checkpoint's."""
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(5, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, 3))
    opt = fastdp.DPOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), module=model, noise_multiplier=sigma,
                             max_grad_norm=0.5, expected_batch_size=BATCH, seed=seed)
    opt.attach_accountant(make_accountant("pld"), BATCH / N)
    loader = poisson_loader(DataLoader(dataset(), batch_size=BATCH), steps=STEPS_PER_EPOCH, seed=seed)
    return model, opt, loader


def train(model, opt, loader, steps, physical=None):
    target = opt.steps + steps
    while opt.steps < target:
        chunks = loader if physical is None else BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical, optimizer=opt)
        for x, y in chunks:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if opt.steps == target:
                break


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("physical", [None, 2])
@pytest.mark.parametrize("how", ["secrets in the file", "seeded", "unseeded"])
def test_resumed_run_is_bit_identical_given_the_seeds(physical, how):
    """The noise key and the sampler seed are secret: a checkpoint holds them only when asked.
    With them (or with the run's seeds given again) the resumed run is bit-identical; without,
    it draws fresh noise and batches and still never restarts epsilon."""
    k, m = 3, 6  # crosses epoch boundaries
    seed = 11 if how == "seeded" else None
    model, opt, loader = build(seed=seed)  # unseeded: seeds come from OS entropy
    train(model, opt, loader, k, physical)
    secrets = how == "secrets in the file"
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader, include_secrets=secrets))
    assert ("key" in state["optimizer"]["noise_seed_state"]) == secrets == ("seed" in state["data_loader"])
    train(model, opt, loader, m, physical)

    model2, opt2, loader2 = build(seed=seed, model_seed=1)
    checkpoint.load_state_dict(state, model=model2, optimizer=opt2, data_loader=loader2)
    assert opt2.accountant.history == [(1.0, BATCH / N, k)]
    train(model2, opt2, loader2, m, physical)
    same = [torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters())]
    assert all(same) if how != "unseeded" else not any(same)
    assert opt2.steps == opt.steps == k + m
    assert opt2.accountant.history == opt.accountant.history


def test_plain_optimizer_state_carries_the_accountant():
    """torch.save(optimizer.state_dict()) restored the step count beside an empty accountant
    history: epsilon restarted from zero (review)."""
    model, opt, loader = build()
    train(model, opt, loader, 3)
    state = roundtrip(opt.state_dict())
    assert "key" not in state["noise_seed_state"]
    model2, opt2, _ = build()
    opt2.load_state_dict(state)
    assert opt2.accountant.history == opt.accountant.history and opt2.epsilon(1e-5) == opt.epsilon(1e-5) > 0
    bare = build()[1]
    bare.accountant = None
    with pytest.raises(ValueError, match="no accountant"):
        bare.load_state_dict(state)


def test_save_and_load_files(tmp_path):
    model, opt, loader = build(seed=3)
    train(model, opt, loader, 2)
    checkpoint.save(tmp_path / "run.pt", model=model, optimizer=opt, data_loader=loader)
    model2, opt2, loader2 = build(seed=4, model_seed=2)
    checkpoint.load(tmp_path / "run.pt", model=model2, optimizer=opt2, data_loader=loader2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert loader2.state_dict() == loader.state_dict()


def test_different_sigma_is_recorded():
    model, opt, loader = build(sigma=1.0)
    train(model, opt, loader, 3)
    state = checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader)
    eps_before = opt.epsilon(1e-5)
    model2, opt2, loader2 = build(sigma=2.0)
    with pytest.warns(UserWarning, match="noise_multiplier"):
        checkpoint.load_state_dict(state, model=model2, optimizer=opt2, data_loader=loader2)
    assert opt2.epsilon(1e-5) == eps_before  # not restarted from zero
    train(model2, opt2, loader2, 2)
    assert opt2.accountant.history == [(1.0, BATCH / N, 3), (2.0, BATCH / N, 2)]
    assert opt2.epsilon(1e-5) > eps_before


def test_checkpoint_from_another_model_is_refused():
    model, opt, loader = build()
    state = checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader)
    model2, opt2, loader2 = build(width=9)
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"shape mismatch: 0\.weight"):
        checkpoint.load_state_dict(state, model=model2, optimizer=opt2)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(5, 3))
    opt3 = fastdp.DPOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), module=other, noise_multiplier=1.0,
                              max_grad_norm=1.0, expected_batch_size=BATCH)
    opt3.attach_accountant(make_accountant("pld"), BATCH / N)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="not in the model: 1.weight"):
        checkpoint.load_state_dict(state, model=other, optimizer=opt3)
    before = [p.detach().clone() for p in model2.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))  # nothing was loaded


def test_refusals():
    model, opt, loader = build()
    with pytest.raises(ValueError, match="not a fastdp checkpoint"):
        checkpoint.load_state_dict({"model": {}}, model=model, optimizer=opt)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="pending"):
        checkpoint.state_dict(model=model, optimizer=opt)
    opt.step()
    state = checkpoint.state_dict(model=model, optimizer=opt)
    with pytest.raises(ValueError, match="no data loader state"):
        checkpoint.load_state_dict(state, model=model, optimizer=opt, data_loader=loader)
    bare_model, bare_opt, _ = build()
    bare_opt.accountant = None
    with pytest.raises(ValueError, match="no accountant"):
        checkpoint.load_state_dict(state, model=bare_model, optimizer=bare_opt)
    state["optimizer"]["accountant"] = None
    with pytest.raises(ValueError, match="restart from zero"):
        checkpoint.load_state_dict(state, model=bare_model, optimizer=build()[1])
    old = build()[1]
    old_state = old.state_dict()
    old_state["noise_seed_state"] = torch.Generator().get_state()  # how older versions stored it
    with pytest.raises(ValueError, match="older fastdp"):
        old.load_state_dict(old_state)


@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_accountant_state_loads_with_weights_only(tmp_path, name):
    acc = make_accountant(name)
    acc.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=50)
    torch.save(acc.state_dict(), tmp_path / "acc.pt")
    restored = make_accountant(name)
    restored.load_state_dict(torch.load(tmp_path / "acc.pt", weights_only=True))
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)


def test_a_refused_load_changes_nothing():
    """The accountant's kind was checked after the wrapped optimizer's state and the step count
    were restored: the refused optimizer, saved again, resumed at step 5 with epsilon 0 (review).
    An empty history beside steps is refused like a missing one."""
    model, opt, loader = build()
    train(model, opt, loader, 3)
    state = roundtrip(opt.state_dict())
    _, other, _ = build()
    other.attach_accountant(make_accountant("rdp"), BATCH / N)
    with pytest.raises(ValueError, match="'pld' accountant"):
        other.load_state_dict(state)
    assert other.steps == 0 and not other.state and other.accountant.steps == 0
    state["accountant"]["history"] = []
    with pytest.raises(ValueError, match="restart from zero"):
        build()[1].load_state_dict(state)


def test_loading_over_recorded_steps_warns_that_their_cost_is_forgotten():
    model, opt, loader = build()
    train(model, opt, loader, 2)
    state = roundtrip(opt.state_dict())
    train(model, opt, loader, 3)
    with pytest.warns(UserWarning, match="replaces the 5 steps"):
        opt.load_state_dict(state)
    assert opt.accountant.steps == 2


def test_the_loader_the_optimizer_steps_on_is_saved_and_restored_by_default():
    """Saved without data_loader=, a seeded run resumed with its seed took the run's first
    batches again, which the accountant counted as fresh Poisson batches (review)."""
    model, opt, loader = build(seed=5)
    opt.attach_loader(loader)
    train(model, opt, loader, 3)
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt))
    assert state["data_loader"]["position"] == 3
    model2, opt2, loader2 = build(seed=5, model_seed=1)
    opt2.attach_loader(loader2)
    checkpoint.load_state_dict(state, model=model2, optimizer=opt2)
    assert loader2.batch_sampler.position == 3
    train(model, opt, loader, 2)
    train(model2, opt2, loader2, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    state["data_loader"] = None  # a checkpoint that holds no loader position
    model3, opt3, loader3 = build(seed=5)
    opt3.attach_loader(loader3)
    with pytest.warns(UserWarning, match="holds no loader position"):
        checkpoint.load_state_dict(state, model=model3, optimizer=opt3)


def test_data_parallel_sampler_state_loads_on_every_rank_of_an_uneven_split():
    """Each rank's sampler saved its own shard size: rank 1 of 2 over 5 examples refused rank
    0's state ('resume with the same dataset'), the documented data-parallel resume (review)."""
    from fastdp.distributed import DistributedPoissonBatchSampler
    samplers = [DistributedPoissonBatchSampler(5, 0.4, seed=1, rank=r, world_size=2) for r in range(2)]
    next(iter(samplers[0]))
    state = samplers[0].state_dict()
    for rank in range(2):
        fresh = DistributedPoissonBatchSampler(5, 0.4, seed=1, rank=rank, world_size=2)
        fresh.load_state_dict(state)
        assert fresh.position == 1


def test_a_sampler_state_loads_at_any_number_of_ranks():
    """Resuming with another number of ranks: 2 -> 1 loaded, 2 -> 3 was refused, and 1 -> 2 was refused
    with a shard size for the dataset's (review). Each step's batch is one Poisson batch of the dataset at
    rate q whatever the number of ranks: all load, and a state of another dataset or rate is refused."""
    from fastdp.distributed import DistributedPoissonBatchSampler
    single = fastdp.PoissonBatchSampler(11, 0.3, seed=1)
    two = DistributedPoissonBatchSampler(11, 0.3, seed=1, rank=0, world_size=2)
    single.position = two.position = 4
    for state in (single.state_dict(), two.state_dict()):
        for world in (1, 2, 3):
            for rank in range(world):
                sampler = DistributedPoissonBatchSampler(11, 0.3, seed=2, rank=rank, world_size=world)
                sampler.load_state_dict(state)
                assert sampler.position == 4
        plain = fastdp.PoissonBatchSampler(11, 0.3, seed=2)
        plain.load_state_dict(state)
        assert plain.position == 4
        for other in (DistributedPoissonBatchSampler(12, 0.3, seed=2, rank=0, world_size=2),
                      DistributedPoissonBatchSampler(11, 0.2, seed=2, rank=0, world_size=2)):
            with pytest.raises(ValueError, match="resume with the same dataset, sample rate and mode"):
                other.load_state_dict(state)


def test_a_load_refused_for_its_loader_state_changes_nothing_and_the_loader_can_be_left_alone():
    """With the optimizer's loader restored by default, a loader over another dataset was
    refused after the optimizer, accountant and model had been loaded (review)."""
    model, opt, loader = build(seed=5)
    opt.attach_loader(loader)
    train(model, opt, loader, 3)
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt))
    model2, opt2, _ = build(model_seed=1)
    bigger = poisson_loader(DataLoader(TensorDataset(torch.randn(N + 8, 5), torch.randint(0, 3, (N + 8,))),
                                       batch_size=BATCH), steps=STEPS_PER_EPOCH)
    opt2.attach_loader(bigger)
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match="num_samples=40, this sampler 48"):
        checkpoint.load_state_dict(state, model=model2, optimizer=opt2)
    assert opt2.steps == 0 and opt2.accountant.steps == 0 and not opt2.state
    assert all(torch.equal(p, q) for p, q in zip(before, model2.parameters()))
    checkpoint.load_state_dict(state, model=model2, optimizer=opt2, data_loader=False)
    assert opt2.steps == 3 and bigger.batch_sampler.position == 0


class _OwnFormatAccountant:
    """An accountant of the user's own, with its own state layout and a lock (not deep-copyable)."""

    def __init__(self):
        import threading
        self.count, self.lock = 0, threading.Lock()

    def step(self, *, noise_multiplier, sample_rate):
        self.count += 1

    def steps(self):  # a method, not a count
        return self.count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_an_accountant_of_the_user_s_own_loads_as_before():
    """The new checks assumed fastdp's state layout and deep-copied the accountant (review)."""
    import warnings as warnings_module
    model, opt, loader = build()
    opt.accountant = _OwnFormatAccountant()
    train(model, opt, loader, 3)
    state = roundtrip(opt.state_dict())
    _, opt2, _ = build()
    opt2.accountant = _OwnFormatAccountant()
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")
        opt2.load_state_dict(state)
    assert opt2.accountant.count == 3 and opt2.steps == 3


def test_a_data_parallel_sampler_state_written_before_global_sizes_still_loads():
    from fastdp.distributed import DistributedPoissonBatchSampler
    old = {"position": 2, "num_samples": 20, "sample_rate": 0.2, "secure_mode": False}  # 40 examples, 2 ranks
    for rank in range(2):
        sampler = DistributedPoissonBatchSampler(40, 0.2, seed=1, rank=rank, world_size=2)
        sampler.load_state_dict(old)
        assert sampler.position == 2


@pytest.mark.filterwarnings("ignore:batch .* released by an earlier step:UserWarning")  # runs it twice on purpose
def test_a_rollback_between_backward_and_step_drops_the_pending_clipped_sums():
    """Loading kept the clipped sums of a backward pass run before it: the step after a rollback
    (reload, draw the same batch again) released each of that batch's samples twice (review)."""
    def third_step(rollback):
        model, opt, loader = build(sigma=0.0, seed=3)
        opt.attach_loader(loader)
        released = []
        opt.attach_step_hook(lambda o: released.append([p.grad.clone() for p in model.parameters()]))
        saved = None
        for i, (x, y) in enumerate(loader):
            nn.functional.cross_entropy(model(x), y).backward()
            if rollback and i == 2:  # e.g. a divergence seen after backward(): back to the last checkpoint
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # the history it replaces is the same: nothing forgotten
                    checkpoint.load_state_dict(saved, model=model, optimizer=opt)
                break
            opt.step()
            opt.zero_grad()
            if i == 1:
                saved = roundtrip(checkpoint.state_dict(model=model, optimizer=opt))
            if i == 2:
                return released[2], opt.accountant.history
        for x, y in loader:  # draws batch 2 again
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            return released[2], opt.accountant.history

    expected, history = third_step(rollback=False)
    got, history_after_rollback = third_step(rollback=True)
    assert history_after_rollback == history
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_a_saved_loader_position_is_not_dropped_when_no_loader_is_known():
    """With no loader given and none attached to the optimizer, the saved position was silently
    skipped: a loader rebuilt with the run's seed replayed the run's batches as fresh (review)."""
    model, opt, loader = build(seed=5)
    train(model, opt, loader, 3)
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader))
    model, opt, loader = build(seed=5)
    with pytest.raises(ValueError, match="data_loader="):
        checkpoint.load_state_dict(state, model=model, optimizer=opt)
    assert opt.steps == 0 and loader.batches_consumed == 0  # refused before anything changed
    checkpoint.load_state_dict(state, model=model, optimizer=opt, data_loader=False)
    assert opt.steps == 3 and loader.batches_consumed == 0


def test_checkpoint_takes_a_batch_memory_manager_for_its_loader():
    """The object a BatchMemoryManager loop iterates was refused with a bare AttributeError (review)."""
    model, opt, loader = build(seed=5)
    opt.attach_loader(loader)
    train(model, opt, loader, 3, physical=2)
    chunks = BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt)
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt, data_loader=chunks))
    model, opt, loader = build(seed=5)
    chunks = BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt)
    checkpoint.load_state_dict(state, model=model, optimizer=opt, data_loader=chunks)
    assert loader.batches_consumed == 3
    with pytest.raises(TypeError, match="Poisson loader"):
        checkpoint.state_dict(model=model, optimizer=opt, data_loader=DataLoader(dataset(), batch_size=BATCH))
    assert checkpoint.state_dict(model=model, optimizer=opt, data_loader=False)["data_loader"] is None


def test_loading_over_other_recorded_steps_warns():
    model, opt, loader = build(seed=5)
    train(model, opt, loader, 2)
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader))
    train(model, opt, loader, 1)
    with pytest.warns(UserWarning, match="replaces the 3 steps"):
        checkpoint.load_state_dict(state, model=model, optimizer=opt, data_loader=loader)
    assert opt.accountant.steps == 2


@pytest.mark.filterwarnings("ignore:batch .* released by an earlier step:UserWarning")  # runs it twice on purpose
@pytest.mark.parametrize("physical", [None, 2])
def test_a_checkpoint_taken_after_the_next_batch_and_before_backward_resumes_with_that_batch(physical):
    """A save at the top of the loop body, the step's batch taken but not trained on, stored the loader
    past it: the resumed run skipped a batch the uninterrupted one trains on (checkpoint review). That
    batch is drawn again on resume: bit-identical runs."""
    model, opt, loader = build(seed=11)
    opt.attach_loader(loader)  # the steps the save knows of
    saved = None
    target = 5
    while opt.steps < target:
        chunks = loader if physical is None else BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical, optimizer=opt)
        for x, y in chunks:
            if opt.steps == 3 and saved is None and not opt.engine.summed:
                saved = roundtrip(checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader,
                                                        include_secrets=True))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if opt.steps == target:
                break
    resumed_model, resumed_opt, resumed_loader = build(seed=99, model_seed=1)
    resumed_opt.attach_loader(resumed_loader)
    checkpoint.load_state_dict(saved, model=resumed_model, optimizer=resumed_opt, data_loader=resumed_loader)
    train(resumed_model, resumed_opt, resumed_loader, target - 3, physical)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert resumed_opt.accountant.history == opt.accountant.history


def test_a_checkpoint_is_refused_while_a_failed_step_can_be_resumed():
    """A step whose wrapped optimizer raised after the release: the checkpoint dropped it, and the resumed
    run stayed a step behind its accountant (checkpoint review). Refused until retried or given up."""
    model, opt, loader = build(seed=5)
    train(model, opt, loader, 1)
    fail = {"now": True}
    inner_step = opt.original_optimizer.step

    def failing_step(*args, **kwargs):
        if fail["now"]:
            raise RuntimeError("the wrapped optimizer failed")
        return inner_step(*args, **kwargs)

    opt.original_optimizer.step = failing_step
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="wrapped optimizer failed"):
        opt.step()
    with pytest.raises(RuntimeError, match="raised part-way"):
        checkpoint.state_dict(model=model, optimizer=opt)
    fail["now"] = False
    opt.step()  # the retry finishes it
    assert opt.steps == 2 and len(opt.accountant) == 2
    checkpoint.state_dict(model=model, optimizer=opt)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_state_of_another_wrapped_optimizer_type_is_refused_and_changes_nothing(momentum):
    """An SGD run's state loaded into a DPOptimizer wrapping Adam: a KeyError (with momentum buffers) or
    nothing at all (without), leaving Adam's groups without betas, its next step counted and then failing
    (checkpoint review). Refused before anything changes; a state of the same type from an older torch
    (groups without the newer settings, which Adam fills in) still loads."""
    model, opt, loader = build(seed=3)
    opt.original_optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    train(model, opt, loader, 2)
    state = roundtrip(checkpoint.state_dict(model=model, optimizer=opt, data_loader=loader))
    model2, opt2, loader2 = build(seed=3, model_seed=1)  # wraps Adam
    before = [dict(g) for g in opt2.param_groups]
    with pytest.raises(ValueError, match=r"no \['betas', 'eps'\] in its parameter groups"):
        checkpoint.load_state_dict(state, model=model2, optimizer=opt2, data_loader=loader2)
    assert [dict(g) for g in opt2.param_groups] == before and opt2.steps == 0
    train(model2, opt2, loader2, 1)
    assert opt2.steps == len(opt2.accountant) == 1
    # the same type, saved by an older torch: its groups lack the settings added since, which Adam fills in
    model3, opt3, loader3 = build(seed=3, model_seed=2)
    train(model3, opt3, loader3, 1)
    old = roundtrip(opt3.state_dict())
    for group in old["optimizer"]["param_groups"]:
        for newer in ("decoupled_weight_decay", "capturable", "differentiable", "fused", "foreach", "maximize"):
            group.pop(newer, None)
    opt3.load_state_dict(old)


def test_same_type_states_load_whatever_extra_keys_their_groups_hold():
    """Refused as another optimizer type: a state saved with parameters() loaded into an optimizer built
    from named_parameters() (param_names), or one saved before an LR scheduler added initial_lr
    (regression review). Only the optimizer's own settings are compared."""
    model, opt, loader = build(seed=3)
    train(model, opt, loader, 1)
    state = roundtrip(opt.state_dict())
    opt.detach()
    named = fastdp.DPOptimizer(torch.optim.Adam(model.named_parameters(), lr=0.05), module=model,
                               noise_multiplier=1.0, max_grad_norm=0.5, expected_batch_size=BATCH)
    named.attach_accountant(make_accountant("pld"), BATCH / N)
    named.load_state_dict(state)
    opt2 = build(seed=3, model_seed=1)[1]
    torch.optim.lr_scheduler.StepLR(opt2, step_size=2)  # adds initial_lr to the groups
    opt2.load_state_dict(state)


def test_an_optimizer_with_its_groups_in_another_order_is_refused_unchanged():
    """torch's load maps the saved per-parameter state and group settings by position: groups built in
    another order took each other's momentum and weight decay, or the next step crashed after it was
    counted (checkpoint review). Equal shapes (two 4x4 layers) would have gone unnoticed."""
    def build_groups(order):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        groups = [{"params": [model[0].weight, model[0].bias], "weight_decay": 0.1},
                  {"params": [model[2].weight, model[2].bias], "weight_decay": 0.0}]
        opt = fastdp.DPOptimizer(torch.optim.SGD(groups[::order], lr=0.1, momentum=0.9), module=model,
                                 noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=3, seed=0)
        opt.attach_accountant(make_accountant("rdp"), 0.1)
        return model, opt

    model, opt = build_groups(1)
    x = torch.randn(3, 4)
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()
    saved = checkpoint.state_dict(model=model, optimizer=opt)
    model2, opt2 = build_groups(-1)
    with pytest.raises(ValueError, match="parameters in another order"):
        checkpoint.load_state_dict(saved, model=model2, optimizer=opt2)
    assert opt2.steps == 0 and opt2.accountant.steps == 0 and not opt2.original_optimizer.state
    model3, opt3 = build_groups(1)
    checkpoint.load_state_dict(saved, model=model3, optimizer=opt3)  # the same order loads
    assert opt3.steps == 1

    def stateless(order):  # one group, no momentum: torch's by-position load moves nothing
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        opt = fastdp.DPOptimizer(torch.optim.SGD(list(model.parameters())[::order], lr=0.1), module=model,
                                 noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=3, seed=0)
        opt.attach_accountant(make_accountant("rdp"), 0.1)
        return model, opt

    model, opt = stateless(1)
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()
    model4, opt4 = stateless(-1)
    checkpoint.load_state_dict(checkpoint.state_dict(model=model, optimizer=opt), model=model4, optimizer=opt4)
    assert opt4.steps == 1  # accepted (regression review: refused although nothing would move)


def test_a_save_inside_a_logical_batch_says_when_to_save():
    """The refusal told the user to save after step() or zero_grad(), neither of which ends a
    BatchMemoryManager logical batch (checkpoint review)."""
    model, opt, loader = build(seed=5)  # batches of about 6 rows: chunks of 2
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for x, y in chunks:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.steps == 0 and opt.engine.summed:
                with pytest.raises(RuntimeError, match="logical batch is open.*optimizer.steps goes up"):
                    checkpoint.state_dict(model=model, optimizer=opt)
                return
    pytest.fail("no chunk left a logical batch open")
