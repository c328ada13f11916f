"""Data formats, models and the training program's flags."""

from __future__ import annotations

import argparse
import io
import pickle
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchspot_lab.datasets import write_synthetic_cifar10, write_synthetic_imagenet
from torchspot_trainer import NODE_FAULT_EXIT
from torchspot_trainer.config import TrainConfig, build_parser, parse_config
from torchspot_trainer.data.datasets import CIFAR_FOLDER, load_cifar10, load_digits, load_imagenet, sample_generator
from torchspot_trainer.data.imaging import resized_crop_box
from torchspot_trainer.data.loader import CPU_LOADER_WORKERS, cgroup_cpus, loader_workers, usable_cpus
from torchspot_trainer.launch import max_world_environment
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.models import SmallCNN, resnet18, resnet50
from torchspot_trainer.optim import RECIPES, BatchRule, build_optimizer, learning_rate, optimizer_kernels
from torchspot_trainer.progress import format_progress, record_means, whole_records
from torchspot_trainer.recovery.notices import NOTICE_LEAVING, NOTICE_RESTART, emergency_saver, notice_level
from torchspot_trainer.recovery.rng import rng_state, set_rng_state
from torchspot_trainer.recovery.signals import SCHEDULED_EVENTS_URL, Notice
from torchspot_trainer.run import (
    NodeFault,
    build_model,
    choose_device,
    choose_in_place,
    exit_node_fault,
    in_place_refusal,
    probe_device,
    sync_bn_refusal,
)


def test_synthetic_cifar_uses_the_real_format(tmp_path: Path) -> None:
    archive = write_synthetic_cifar10(tmp_path / "cifar-10-python.tar.gz", n_train=50, n_test=10)
    with tarfile.open(archive) as tar:
        names = sorted(m.name for m in tar.getmembers())
        member = tar.extractfile(f"{CIFAR_FOLDER}/data_batch_1")
        assert member is not None
        with member:
            batch = pickle.load(member, encoding="bytes")
    assert f"{CIFAR_FOLDER}/test_batch" in names
    assert batch[b"data"].shape == (10, 3072)
    assert batch[b"data"].dtype.name == "uint8"
    assert len(batch[b"labels"]) == 10

    train, test = load_cifar10(archive)
    assert (len(train), len(test)) == (50, 10)
    image, label = test[0]
    assert image.shape == (3, 32, 32)
    assert 0 <= label < 10
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "extracted", filter="data")
    train_dir, _ = load_cifar10(tmp_path / "extracted")
    assert len(train_dir) == 50
    # The tarball's folder, as a copied Blob prefix leaves it (az://datasets/cifar10 -> the cache).
    train_cache, _ = load_cifar10(tmp_path)
    assert len(train_cache) == 50


def test_imagenet_folder_decodes_jpeg(tmp_path: Path) -> None:
    root = write_synthetic_imagenet(tmp_path / "imagenet", classes=3, per_class=4, size=48)
    train, val = load_imagenet(root, size=32)
    assert train.classes == ["n00000000", "n00000001", "n00000002"]
    assert len(train) == 12
    image, label = val[0]
    assert image.shape == (3, 32, 32)
    assert label == 0


def test_a_sample_is_augmented_the_same_on_any_rank_worker_or_resume(tmp_path: Path) -> None:
    """The crop and flip of sample i in epoch e come from (seed, e, i) only: a copy of the data set in
    another process (a rank, a loader worker, a resumed run) draws the same; another epoch differs."""
    root = write_synthetic_imagenet(tmp_path / "imagenet", classes=2, per_class=4, size=48)
    one, _ = load_imagenet(root, size=32)
    other, _ = load_imagenet(root, size=32)  # as another rank or a resumed process would load it
    torch.manual_seed(1)  # process-level random state: must not matter
    one.set_epoch(3, seed=7)
    first = [one[i][0] for i in range(len(one))]
    torch.manual_seed(2)
    other.set_epoch(3, seed=7)
    assert all(torch.equal(a, other[i][0]) for i, a in enumerate(first))
    other.set_epoch(4, seed=7)
    assert not all(torch.equal(a, other[i][0]) for i, a in enumerate(first))  # a new epoch, new crops
    cifar_train, _ = load_cifar10(write_synthetic_cifar10(tmp_path / "cifar.tar.gz", n_train=50, n_test=10))
    cifar_train.set_epoch(0, seed=7)
    again = [cifar_train[i][0] for i in range(16)]
    torch.manual_seed(99)
    assert all(torch.equal(a, cifar_train[i][0]) for i, a in enumerate(again))
    assert sample_generator(7, 0, 5).initial_seed() != sample_generator(7, 0, 6).initial_seed()


def test_resized_crops_follow_the_standard_recipe() -> None:
    """RandomResizedCrop's region: 8-100% of the area, aspect 3:4 to 4:3, inside the image."""
    areas, ratios = [], []
    for index in range(400):
        left, top, right, bottom = resized_crop_box(500, 375, sample_generator(0, 0, index))
        assert 0 <= left < right <= 500
        assert 0 <= top < bottom <= 375
        areas.append((right - left) * (bottom - top) / (500 * 375))
        ratios.append((right - left) / (bottom - top))
    assert 0.07 < min(areas) < 0.2
    assert max(areas) > 0.8
    assert all(0.74 < r < 1.35 for r in ratios)
    assert resized_crop_box(1000, 100, sample_generator(0, 0, 0))[2] <= 1000  # extreme shapes still fit


def test_digits_are_sklearns_bundled_set() -> None:
    """The same images and labels as scikit-learn's own loader gives (read from its file without it)."""
    from sklearn.datasets import load_digits as sklearns

    train, test = load_digits()
    assert len(train) + len(test) == 1797
    image, _ = train[0]
    assert image.shape == (1, 8, 8)
    bunch = sklearns()
    ours = torch.cat([train.images, test.images]).squeeze(1)
    expected = torch.from_numpy((bunch.images * (255.0 / 16.0)).astype("uint8"))
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(0))  # load_digits' split
    assert torch.equal(ours, expected[order])
    assert torch.cat([train.labels, test.labels]).tolist() == [int(bunch.target[i]) for i in order]


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        (load_cifar10, "not a CIFAR-10 python data set"),
        (load_imagenet, "one folder per class"),
    ],
    ids=["cifar", "imagenet"],
)
def test_wrong_data_path_is_named(tmp_path: Path, loader: object, message: str) -> None:
    with pytest.raises(FileNotFoundError, match=message):
        loader(tmp_path)  # type: ignore[operator]


def test_models_have_the_expected_shapes() -> None:
    assert resnet18(10)(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    big = resnet50(1000)
    assert sum(p.numel() for p in big.parameters()) == pytest.approx(25.56e6, rel=0.01)
    assert big(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)
    assert SmallCNN(10)(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    # A rank with no samples in the epoch's short last step still runs forward/backward.
    empty = resnet18(10)(torch.zeros(0, 3, 32, 32))
    assert empty.shape == (0, 10)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--data", "x", "--model", "vgg"], "--model 'vgg'"),
        (["--data", "x", "--epochs", "0"], "--epochs 0"),
        (["--data", "x", "--batch-size", "0"], "--batch-size 0"),
        (["--data", "x", "--lr", "-1"], "--lr -1"),
        (["--data", "x", "--warmup", "1.5"], "--warmup 1.5"),
        (["--data", "x", "--keep-checkpoints", "0"], "--keep-checkpoints 0"),
        (["--data", "x", "--scheduled-events", "sometimes"], "--scheduled-events 'sometimes'"),
        (["--data", "x", "--scheduled-events", "httpd"], "--scheduled-events 'httpd'"),  # a URL's scheme is whole
        (["--data", "", "--dataset", "cifar10"], "--data is required"),
        (["--data", "x", "--dataset", "mnist"], "--dataset 'mnist'"),
        (["--data", "x", "--checkpoint-saver", "fork"], "--checkpoint-saver 'fork'"),
        (["--data", "x", "--workers", "-1"], "--workers '-1'"),
        (["--data", "x", "--workers", "many"], "--workers 'many'"),
    ],
)
def test_bad_training_flags_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_help_documents_every_flag() -> None:
    """Every flag has a help text of its own (a flag added without one fails here), and the help names
    what a user reads it for."""
    parser = build_parser()
    flags = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert len(flags) >= 40
    undocumented = [action.option_strings[0] for action in flags if not (action.help or "").strip()]
    assert undocumented == []
    text = parser.format_help()
    assert "az://container/prefix" in text


def test_scheduled_events_are_watched_in_kubernetes_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """--scheduled-events auto (the default): Azure's metadata endpoint in a pod, nothing elsewhere; off:
    nothing; a URL: that one (the tests' stand-in for the metadata service)."""
    base = ["--dataset", "digits", "--model", "small_cnn", "--data", ""]
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert parse_config(base).scheduled_events == "auto"
    assert parse_config(base).scheduled_events_url() is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert parse_config(base).scheduled_events_url() == SCHEDULED_EVENTS_URL
    assert parse_config([*base, "--scheduled-events", "off"]).scheduled_events_url() is None
    url = "http://127.0.0.1:9999/metadata/scheduledevents"
    assert parse_config([*base, "--scheduled-events", url]).scheduled_events_url() == url


@pytest.mark.parametrize(
    ("levels", "saver"),
    [
        ([0, 0, NOTICE_LEAVING], 2),
        ([NOTICE_RESTART, NOTICE_LEAVING, NOTICE_LEAVING], 1),
        ([NOTICE_RESTART, NOTICE_RESTART, 0], None),
        ([NOTICE_LEAVING, 0], 0),
    ],
    ids=["the-leaving-rank", "lowest-leaving", "restarts-only", "rank-0-leaves"],
)
def test_the_emergency_checkpoint_is_written_by_a_leaving_rank(levels: list[int], saver: int | None) -> None:
    assert emergency_saver(levels) == saver


_SIGTERM = Notice("SIGTERM", "pod deletion or agent restart", 0.0)
_PREEMPT = Notice("ScheduledEvents", "Preempt", 0.0, event_id="e1")


@pytest.mark.parametrize(
    ("notice", "restarting", "leaving", "level"),
    [
        (None, False, False, 0),
        (_SIGTERM, True, False, NOTICE_RESTART),
        (_SIGTERM, False, False, NOTICE_LEAVING),
        (_PREEMPT, True, False, NOTICE_LEAVING),
        (None, False, True, NOTICE_LEAVING),
        (_SIGTERM, True, True, NOTICE_LEAVING),
    ],
    ids=["none", "agent-restart", "pod-deleted", "scheduled-event", "leaving-before-sigterm", "leaving-mid-restart"],
)
def test_notice_level_says_leaving_when_the_agent_marked_the_node_leaving(
    notice: Notice | None, restarting: bool, leaving: bool, level: int
) -> None:
    """The agent's leaving marker wins: its SIGTERM may not have reached the worker yet, or a
    restart was under way when the node was told to go (CI lost an emergency checkpoint so)."""
    assert notice_level(notice, restarting=restarting, leaving=leaving) == level


def test_learning_rate_schedules() -> None:
    assert learning_rate(1.0, schedule="cosine", warmup=0.1, progress=0.05) == pytest.approx(0.5)
    assert learning_rate(1.0, schedule="cosine", warmup=0.1, progress=0.1) == pytest.approx(1.0)
    assert learning_rate(1.0, schedule="cosine", warmup=0.1, progress=1.0) == pytest.approx(0.0, abs=1e-9)
    steps = [learning_rate(1.0, schedule="step", warmup=0.0, progress=p) for p in (0.2, 0.6, 0.8)]
    assert steps == pytest.approx([1.0, 0.1, 0.01])


@pytest.mark.parametrize(
    ("scaling", "world", "peak"),
    [("none", 4, 0.1), ("linear", 1, 0.05), ("linear", 4, 0.2), ("sqrt", 8, 0.2), ("sqrt", 2, 0.1)],
)
def test_per_worker_batches_scale_the_learning_rate_by_the_chosen_rule(scaling: str, world: int, peak: float) -> None:
    """lr 0.1 is stated for 256 samples; 128 per worker gives 128 x world per step."""
    rule = BatchRule(global_batch_size=0, batch_size=128, lr=0.1, lr_batch=256, lr_scaling=scaling)
    assert rule.peak_lr(world) == pytest.approx(peak)


@pytest.mark.parametrize("scaling", ["none", "linear", "sqrt"])
def test_a_global_batch_gives_one_learning_rate_at_every_world_size(scaling: str) -> None:
    rule = BatchRule(global_batch_size=1024, batch_size=128, lr=0.1, lr_batch=256, lr_scaling=scaling)
    assert len({rule.peak_lr(world) for world in (1, 2, 3, 8)}) == 1
    assert {rule.step_batch(world) for world in (1, 3, 8)} == {1024}
    assert BatchRule.from_state(rule.state_dict()) == rule


def test_a_resumed_run_keeps_the_rule_its_checkpoint_recorded_and_names_the_flags_it_ignores() -> None:
    """Per-worker batches with linear scaling, recorded at 4 workers and resumed at 2 with other
    flags: the recorded rule scales the learning rate to the new world size."""
    recorded = BatchRule(global_batch_size=0, batch_size=64, lr=0.1, lr_batch=256, lr_scaling="linear")
    flags = BatchRule(global_batch_size=0, batch_size=32, lr=0.1, lr_batch=256, lr_scaling="none")
    rule, ignored = flags.resumed(torch.load(_saved(recorded.state_dict()), weights_only=True))
    assert rule == recorded
    assert ignored == {"batch_size": (32, 64), "lr_scaling": ("none", "linear")}
    assert rule.peak_lr(2) == pytest.approx(0.05)
    assert flags.resumed(None) == (flags, {})  # a checkpoint from before rules were recorded
    assert recorded.resumed(recorded.state_dict()) == (recorded, {})


def _saved(state: dict[str, object]) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_data_sets_reference_recipes_are_the_defaults() -> None:
    imagenet = TrainConfig(data="x", dataset="imagenet", model="resnet50")
    assert (imagenet.recipe().lr, imagenet.recipe().lr_batch, imagenet.recipe().weight_decay) == (0.1, 256, 1e-4)
    assert TrainConfig(data="x", dataset="cifar10").recipe().weight_decay == 5e-4
    mine = TrainConfig(data="x", dataset="imagenet", lr=0.2, weight_decay=5e-5, lr_batch=512)
    assert (mine.recipe().lr, mine.recipe().lr_batch, mine.recipe().weight_decay) == (0.2, 512, 5e-5)
    assert all(recipe.source for recipe in RECIPES.values())


def test_recipe_flags_parse_with_no_default_of_their_own(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_config(["--dataset", "imagenet", "--data", "d", "--lr", "0.4", "--sync-bn"])
    assert (config.lr, config.weight_decay, config.lr_batch, config.sync_bn) == (0.4, None, None, True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    shown = capsys.readouterr().out
    assert "(default: None)" not in shown.split("--lr LR", 1)[1].split("--optimizer", 1)[0]
    for bad, flag in [("--lr-scaling=cube", "--lr-scaling"), ("--global-batch-size=-1", "--global-batch-size"),
                      ("--micro-batch-size=-2", "--micro-batch-size"), ("--lr-batch=0", "--lr-batch")]:  # fmt: skip
        with pytest.raises(SystemExit):
            parse_config(["--dataset", "digits", "--data", "", bad])
        assert flag in capsys.readouterr().err


def test_sync_bn_converts_every_batch_norm_and_is_refused_on_cpu() -> None:
    config = TrainConfig(data="x", model="resnet18", sync_bn=True)
    model = build_model(config, 10, torch.device("cpu"))
    kinds = {type(m) for m in model.modules()}
    assert torch.nn.SyncBatchNorm in kinds
    assert torch.nn.BatchNorm2d not in kinds
    refusal = sync_bn_refusal(True, torch.device("cpu"))
    assert refusal is not None
    assert "--sync-bn" in refusal
    assert sync_bn_refusal(True, torch.device("cuda", 0)) is None
    assert sync_bn_refusal(False, torch.device("cpu")) is None


def test_in_place_is_refused_outside_torchspot_run_and_with_sync_bn() -> None:
    """--in-place: only torchspot-run's agent hands rounds over (on any device: planes.py)."""
    agent = {PEER_LOST_ENV: "/tmp/agent/peer-lost"}
    assert in_place_refusal(True, agent) is None
    assert in_place_refusal(False, {}) is None
    said = in_place_refusal(True, agent, sync_bn=True)  # SyncBatchNorm would be silently local in place
    assert said is not None
    assert "--sync-bn" in said
    assert "--in-place" in said
    assert in_place_refusal(False, agent, sync_bn=True) is None
    elsewhere = in_place_refusal(True, {})
    assert elsewhere is not None
    assert "--in-place" in elsewhere
    assert "torchspot-run" in elsewhere
    assert in_place_refusal(None, {}, sync_bn=True) is None  # unset: choose_in_place takes the restart path


@pytest.mark.parametrize(
    ("flag", "under_ours", "sync_bn", "in_place", "said"),
    [
        (None, True, False, True, "in place, torchspot-run's agent hands this worker each new round"),
        (None, False, False, False, "the restart path: in place needs torchspot-run"),
        (None, True, True, False, "the restart path: --sync-bn"),
        (False, True, False, False, "the restart path, as asked (--no-in-place)"),
        (True, True, False, True, "in place, as asked (--in-place)"),
    ],
)
def test_the_trainer_re_forms_in_place_unless_told_otherwise_or_it_cannot(
    flag: bool | None, under_ours: bool, sync_bn: bool, in_place: bool, said: str
) -> None:
    """--in-place unset: in place wherever it can run, else the restart path with the reason in one line,
    which names what to change."""
    environ = {PEER_LOST_ENV: "/tmp/agent/peer-lost"} if under_ours else {}
    chosen, why = choose_in_place(flag, environ, sync_bn=sync_bn)
    assert chosen is in_place
    assert why.startswith(said)
    assert any(cause in why for cause in ("--no-in-place", "--in-place", "torchspot-run", "--sync-bn"))
    on_gpus = choose_in_place(flag, environ, sync_bn=sync_bn, nccl=True)
    assert on_gpus[0] is in_place
    assert ("not measured" in on_gpus[1]) is in_place  # said wherever NCCL's path is taken


def test_in_place_unset_is_a_switch_left_unset_and_its_variable_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bool | None` flags parse as switches whose absence leaves None (config.build_parser)."""
    assert parse_config(["--data", "x"]).in_place is None
    assert parse_config(["--data", "x", "--in-place"]).in_place is True
    assert parse_config(["--data", "x", "--no-in-place"]).in_place is False
    monkeypatch.setenv("TORCHSPOT_IN_PLACE", "false")
    assert parse_config(["--data", "x"]).in_place is False
    assert parse_config(["--data", "x", "--in-place"]).in_place is True  # the flag wins


@pytest.mark.parametrize(("dataset", "model", "shape"), [
    ("digits", "small_cnn", (1, 8, 8)), ("cifar10", "small_cnn", (3, 32, 32)), ("cifar10", "resnet18", (3, 32, 32)),
])  # fmt: skip
def test_a_model_takes_its_data_sets_images(dataset: str, model: str, shape: tuple[int, ...]) -> None:
    """The first layer takes the data set's channels: small_cnn trains on CIFAR-10 as well as digits
    (the sandbox's test runs the demo's CIFAR job with it, where ResNet-18's cost would not count)."""
    built = build_model(TrainConfig(data="x", dataset=dataset, model=model), 10, torch.device("cpu"))
    assert built(torch.zeros(2, *shape)).shape == (2, 10)


def test_model_initialisation_is_the_same_on_every_rank() -> None:
    """Every rank builds the model from --seed, whatever its RNG did before."""
    config = TrainConfig(data="x", dataset="digits", model="small_cnn", seed=4)
    first = build_model(config, 10, torch.device("cpu"))
    torch.rand(1000)  # another rank's generator has moved on
    second = build_model(config, 10, torch.device("cpu"))
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _draws() -> tuple[torch.Tensor, float, float, float]:
    """One draw of each generator the state holds (Python's Gaussian uses its spare value first)."""
    return torch.rand(3), random.random(), random.gauss(0.0, 1.0), float(np.random.rand())


def test_rng_state_roundtrips_through_a_safe_load(tmp_path: Path) -> None:
    random.gauss(0.0, 1.0)  # leaves a spare Gaussian value in Python's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = _draws()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    drawn = _draws()
    assert torch.equal(drawn[0], expected[0])
    assert drawn[1:] == expected[1:]


def test_rng_state_of_an_older_checkpoint_still_loads() -> None:
    """Before 2026-11-28 Python's words and its spare Gaussian value were saved as one list."""
    version, words, gauss = random.getstate()
    older = {**rng_state(), "python": [*words, gauss], "python_version": version}
    del older["python_gauss"]
    expected = _draws()
    set_rng_state(older)
    drawn = _draws()
    assert torch.equal(drawn[0], expected[0])
    assert drawn[1:] == expected[1:]


@pytest.mark.parametrize(
    ("flag", "cuda", "want"),
    [
        ("auto", True, ("cuda", "nccl")),
        ("auto", False, ("cpu", "gloo")),
        ("cpu", True, ("cpu", "gloo")),
        ("cuda", True, ("cuda", "nccl")),
    ],
)
def test_backend_follows_the_device(flag: str, cuda: bool, want: tuple[str, str]) -> None:
    device, backend = choose_device(flag, cuda, local_rank=1)
    assert (device.type, backend) == want
    if device.type == "cuda":
        assert device.index == 1


def test_cuda_required_where_it_is_not_usable_stops_naming_the_node() -> None:
    """`--device cuda` (what the operator passes GPU jobs) never falls back to gloo: one gloo rank among
    NCCL ranks hangs the group's set-up. A GPU the node cannot use is the node's fault (NodeFault: the
    worker exits with NODE_FAULT_EXIT and is replaced elsewhere); a torch without CUDA is the image's,
    which every node shares (a plain error)."""
    with pytest.raises(NodeFault, match=r"CUDA is not usable on node aks-gpu-7.*nvidia-smi"):
        choose_device("cuda", False, local_rank=0, node="aks-gpu-7")
    with pytest.raises(NodeFault, match=r"local rank 4 but 4 GPU\(s\) visible on node aks-gpu-7"):
        choose_device("cuda", True, local_rank=4, gpus=4, node="aks-gpu-7")
    with pytest.raises(ValueError, match=r"built without CUDA") as image:
        choose_device("cuda", False, local_rank=0, node="aks-gpu-7", cuda_built=False)
    assert not isinstance(image.value, NodeFault)
    assert choose_device("auto", False, local_rank=0, node="aks-gpu-7")[1] == "gloo"  # auto: per process
    probe_device(torch.device("cpu"))  # nothing to probe on the CPU (a GPU's probe: test_cuda.py)


def test_a_node_fault_exits_with_the_code_the_agent_and_the_operator_read(capsys: pytest.CaptureFixture[str]) -> None:
    """The worker says why on its stderr and exits with NODE_FAULT_EXIT, which its agent (handover.py) and
    the operator (verdicts.py) take as "this node cannot run the program"."""
    with pytest.raises(SystemExit) as exited:
        exit_node_fault(NodeFault("the GPU cuda:0 failed a first computation: CUDA error: uncorrectable ECC error"))
    assert exited.value.code == NODE_FAULT_EXIT == 75
    assert "node fault: the GPU cuda:0 failed a first computation" in capsys.readouterr().err


def test_a_step_applied_once_counts_once_whoever_recorded_it() -> None:
    """`whole_records`, the exactly-once audit: a partial record never counts. After a double fault
    (rank 0, on node a, completed step 11 alone in generation 4, wrote its record and was lost; b and c,
    which never applied it, trained it again in generation 5) the surviving line applied step 11 once.
    Before, it counted twice. A step a line trained twice (here 12, by b in generations 5 and 6: b was
    in 6) still counts twice."""

    def progress(step: int, generation: int, node: str, **extra: Any) -> dict[str, Any]:
        return {"event": "progress", "step": step, "generation": generation, "node": node, **extra}

    events = [
        *({"event": "generation", "generation": 4, "node": node} for node in "abc"),
        progress(10, 4, "a"), progress(11, 4, "a"),
        *({"event": "generation", "generation": 5, "node": node} for node in "bc"),
        progress(11, 5, "b"), progress(12, 5, "b"), progress(13, 5, "b", partial=True),
        *({"event": "generation", "generation": 6, "node": node} for node in "bc"),
        progress(12, 6, "b"), progress(14, 6, "b"),
    ]  # fmt: skip
    assert whole_records(events) == {10: 1, 11: 1, 12: 2, 14: 1}
    no_members = [e for e in events if e["event"] == "progress"]  # nothing known of who was in a generation
    assert whole_records(no_members)[11] == 2


def test_a_record_divides_the_groups_sums_by_the_samples_they_came_from() -> None:
    """`record_means`: a heal's receiver that sorts first (rank 0) sat a step out with a window of that
    step alone, while its trainers' windows held four steps of 48 samples: their losses' mean is over
    the samples summed alike (192), not over the receiver's window (48: a loss four times too large,
    an accuracy above 1)."""
    loss, accuracy = record_means(192 * 0.5, 180.0, 192.0)
    assert loss == pytest.approx(0.5)
    assert accuracy == pytest.approx(180 / 192)
    assert record_means(0.0, 0.0, 0.0) == (0.0, 0.0)  # nothing computed


def test_progress_line_for_a_terminal() -> None:
    record = {
        "step": 1200, "epoch": 3, "world_size": 2, "loss": 0.51234, "accuracy": 0.8766, "samples_per_s": 1530.2,
        "lr": 0.0125, "checkpoint_step": 1000, "checkpoint_error": None, "step_samples": 512,
    }  # fmt: skip
    line = format_progress(record)
    assert line == "step    1200 epoch   3 world 2 loss 0.5123 acc 0.877 1530 samples/s lr 0.0125 batch 512 ckpt 1000"
    failing = format_progress({**record, "checkpoint_error": "step 1200: blob unreachable"})
    assert failing.endswith("CHECKPOINT FAILING: step 1200: blob unreachable")


def test_flag_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator passes a job's checkpoint settings as TORCHSPOT_<FLAG>; the command line still wins."""
    monkeypatch.setenv("TORCHSPOT_CHECKPOINT_URI", "az://ckpt/job")
    monkeypatch.setenv("TORCHSPOT_CHECKPOINT_EVERY", "50")
    config = parse_config(["--dataset", "digits", "--data", ""])
    assert (config.checkpoint_uri, config.checkpoint_every) == ("az://ckpt/job", 50)
    assert parse_config(["--dataset", "digits", "--data", "", "--checkpoint-every", "7"]).checkpoint_every == 7


def test_bad_value_from_the_environment_names_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHSPOT_CHECKPOINT_EVERY", "often")
    with pytest.raises(SystemExit):
        parse_config(["--dataset", "digits", "--data", ""])
    assert "--checkpoint-every" in capsys.readouterr().err


def test_a_global_batch_keeps_the_largest_worlds_share_as_its_micro_batch() -> None:
    """torchspot-run tells its workers the largest world (--nnodes 2:8, 8 a node: 64); with G = 1024 each
    pass is then 16 samples at any world, where the whole share grew to 128 at 1 node (CUDA OOM)."""
    args = argparse.Namespace(nnodes="2:8", nproc_per_node="8")
    assert max_world_environment(args, {}) == {"TORCHSPOT_MAX_WORLD_SIZE": "64"}
    assert max_world_environment(args, {"TORCHSPOT_MAX_WORLD_SIZE": "16"}) == {}  # the user's stays
    assert max_world_environment(argparse.Namespace(nnodes="1:4", nproc_per_node="gpu"), {}) == {}
    config = TrainConfig(data="d", global_batch_size=1024, max_world_size=64)
    assert config.micro_batch(1024) == 16
    assert config.micro_batch(1000) == 16  # rounded up: 63 ranks x 16 >= 1000
    assert TrainConfig(data="d", global_batch_size=1024, max_world_size=64, micro_batch_size=32).micro_batch(1024) == 32
    assert (
        TrainConfig(data="d", max_world_size=64).micro_batch(0) == 0
    )  # no global batch: the per-worker batch as given
    assert TrainConfig(data="d", global_batch_size=1024).micro_batch(1024) == 0  # plain torchrun: not known
    assert (
        TrainConfig(data="d", global_batch_size=1024, max_world_size=64, sync_bn=True).micro_batch(1024) == 0
    )  # one pass


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_optimizer_is_fused_on_a_gpu_and_torchs_default_on_a_cpu(name: str) -> None:
    """Fused on a GPU: a few kernels per update, and fp16's scaler passes its found-inf flag on the
    device (no host sync per step). On a CPU what the CPU figures were measured with."""
    assert optimizer_kernels(torch.device("cuda", 0)) is True
    assert optimizer_kernels(torch.device("cpu")) is None
    optimizer = build_optimizer(torch.nn.Linear(2, 2), name, lr=0.1, weight_decay=0.0, device=torch.device("cpu"))
    assert not optimizer.param_groups[0]["fused"]


def test_loader_workers_are_sized_from_the_cores_on_a_gpu_and_kept_small_on_a_cpu() -> None:
    """auto on a GPU: the node's cores shared among its training processes, one each kept for the
    process itself; on a CPU the step computes on those cores, so 2; a number is taken as given."""
    assert parse_config(["--data", "x"]).workers == "auto"  # the default
    assert loader_workers("auto", cuda=True, cpus=96, local_ranks=8) == 11  # ND96 H100 v5
    assert loader_workers("auto", cuda=True, cpus=64, local_ranks=4) == 15  # NC64as T4 v3
    assert loader_workers("auto", cuda=True, cpus=4, local_ranks=4) == 1  # never none
    assert loader_workers("auto", cuda=False, cpus=96, local_ranks=1) == CPU_LOADER_WORKERS
    assert loader_workers("0", cuda=True, cpus=96, local_ranks=8) == 0


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [("max 100000", None), ("800000 100000", 8.0), ("150000 100000", 1.5), ("", None), ("x y", None)],
)
def test_a_containers_cpu_limit_is_read_from_cgroup_v2(cpu_max: str, cores: float | None) -> None:
    assert cgroup_cpus(cpu_max) == cores
    assert usable_cpus() > 0  # this machine's own: its affinity, or its limit where lower
