"""Each task's loss and metrics (trainer/tasks/), in process, against scikit-learn and SciPy;
tests/e2e/test_task_training.py trains each under torchrun."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from scipy import stats
from sklearn import metrics as sk

from trainer.runtime.environment import DistEnv
from trainer.tasks import registry as tasks
from trainer.tasks.space import Labels

DATA = OmegaConf.create({"threshold": 0.5})


def task(problem_type: str, names=("a", "b", "c", "d"), weights=None, smoothing=0.0):
    labels = Labels(problem_type, () if problem_type == "regression" else names, "test", "ids", weights=weights)
    return tasks.of(labels, DATA, OmegaConf.create({"label_smoothing": smoothing}))


def tallied(t, logits: torch.Tensor, labels: torch.Tensor, batches: int = 3):
    """Metrics from a tally fed in `batches` pieces (as an eval loader feeds it)."""
    tally = t.tally(torch.device("cpu"))
    for rows in np.array_split(np.arange(len(labels)), batches):
        tally.add(logits[rows], labels[rows], rows.tolist())
    return tally.finish(DistEnv())


def test_multi_label_metrics_are_scikit_learns():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 4, generator=generator)
    truth = (torch.rand(50, 4, generator=generator) > 0.6).float()
    truth[:, 3] = 0  # a label no row holds: macro F1 leaves out what is neither true nor predicted
    logits[:, 3] = -5
    metrics, _ = tallied(task("multi_label"), logits, truth)
    predicted = (torch.sigmoid(logits) >= 0.5).numpy()
    present = [0, 1, 2]
    assert metrics["f1_micro"] == pytest.approx(sk.f1_score(truth.numpy(), predicted, average="micro"))
    assert metrics["f1_macro"] == pytest.approx(sk.f1_score(truth.numpy()[:, present], predicted[:, present],
                                                            average="macro"))
    assert metrics["subset_accuracy"] == pytest.approx(sk.accuracy_score(truth.numpy(), predicted))


def test_regression_metrics_are_scipys_in_row_order_whatever_the_batches():
    generator = torch.Generator().manual_seed(1)
    truth = torch.randint(0, 6, (40,), generator=generator).float()  # ties, as STS-B's scores have
    predicted = truth + torch.randn(40, generator=generator)
    metrics, details = tallied(task("regression"), predicted.unsqueeze(-1), truth)
    assert metrics["mse"] == pytest.approx(float(((predicted - truth) ** 2).mean()))
    assert metrics["mae"] == pytest.approx(float((predicted - truth).abs().mean()))
    assert metrics["pearson"] == pytest.approx(stats.pearsonr(predicted, truth).statistic)
    assert metrics["spearman"] == pytest.approx(stats.spearmanr(predicted, truth).statistic)
    assert tallied(task("regression"), predicted.unsqueeze(-1), truth, batches=7)[0] == metrics
    assert np.array_equal(details["pairs"][1], truth.double().numpy())


def test_single_label_metrics_are_scikit_learns():
    generator = torch.Generator().manual_seed(2)
    logits, truth = torch.randn(60, 4, generator=generator), torch.randint(0, 4, (60,), generator=generator)
    metrics, _ = tallied(task("single_label"), logits, truth)
    assert metrics["accuracy"] == pytest.approx(sk.accuracy_score(truth, logits.argmax(-1)))
    assert metrics["f1_macro"] == pytest.approx(sk.f1_score(truth, logits.argmax(-1), average="macro"))


def test_weighted_and_smoothed_losses_are_torchs_per_sample():
    logits, truth = torch.randn(6, 3), torch.tensor([0, 1, 2, 2, 1, 0])
    weights = (0.5, 2.0, 1.0)
    losses = task("single_label", ("a", "b", "c"), weights=weights, smoothing=0.1).sample_losses(logits, truth)
    plain = torch.nn.functional.cross_entropy(logits, truth, reduction="none", label_smoothing=0.1)
    assert torch.allclose(losses, plain * torch.tensor(weights)[truth])
    # Not divided by the batch's weights: a rank's mean is its share of the global batch's.
    halves = [losses[:3].mean(), losses[3:].mean()]
    assert torch.allclose((halves[0] + halves[1]) / 2, losses.mean())
    hot = torch.tensor([[1.0, 0.0, 1.0]] * 6)
    multi = task("multi_label", ("a", "b", "c"), weights=(3.0, 1.0, 0.5)).sample_losses(logits, hot)
    assert torch.allclose(multi, torch.nn.functional.binary_cross_entropy_with_logits(
        logits, hot, pos_weight=torch.tensor([3.0, 1.0, 0.5]), reduction="none").mean(-1))


def test_predictions_answer_with_names():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    assert task("single_label").predictions(logits)[0]["label_name"] == "a"
    multi = task("multi_label").predictions(logits)[0]
    assert (multi["labels"], multi["label_names"]) == ([0, 2], ["a", "c"])
    assert task("multi_label").csv_row(multi)[:2] == ["0|2", "a|c"]
    assert task("regression").predictions(torch.tensor([[1.5]])) == [{"value": 1.5}]


@pytest.mark.parametrize("problem_type", ["single_label", "multi_label"])
def test_a_picture_of_many_classes_keeps_a_size_that_can_be_drawn(problem_type, tmp_path):
    """The evaluation's picture grew with the classes: a confusion matrix of 300 took 122 s and
    8 GB, one of 1,000 ran out of memory on rank 0, which draws it while the other ranks wait.
    Beyond the classes a picture can name, it keeps the size of that many."""
    from PIL import Image

    from trainer.tasks.base import NAMED_IN_PLOTS
    from trainer.tasks.space import placeholder_names

    def drawn(classes: int) -> tuple[int, int]:
        t = task(problem_type, names=placeholder_names(classes))
        generator = torch.Generator().manual_seed(classes)
        truth = torch.randint(0, classes, (4 * classes,), generator=generator)
        if problem_type == "multi_label":
            truth = torch.nn.functional.one_hot(truth, classes).float()
        _, details = tallied(t, torch.randn(4 * classes, classes, generator=generator), truth)
        t.plot(details, "validation", tmp_path / f"{classes}.png")
        with Image.open(tmp_path / f"{classes}.png") as image:
            return image.size

    assert drawn(100) == drawn(NAMED_IN_PLOTS)
