"""The stage's progress bar inside a Lightning fit: every frame it draws on stderr carries the stage's label."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpltm.training.plain import RoundProgressBar, lightning_trainer


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _frames(text: str) -> list[str]:
    return [frame.strip() for frame in text.replace("\r", "\n").splitlines() if "|" in frame]


@pytest.mark.parametrize("epochs", [1, 3])
def test_every_frame_of_the_bar_names_the_stage_not_lightnings_epoch(capsys: pytest.CaptureFixture[str],
                                                                     epochs: int) -> None:
    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = lightning_trainer(torch.device("cpu"), max_epochs=epochs, logger=False, enable_progress_bar=True,
                                callbacks=[RoundProgressBar("DP training", refresh_rate=1)])
    trainer.fit(_Tiny(), train_dataloaders=data)
    frames = _frames(capsys.readouterr().err)
    assert frames, "the bar drew nothing"
    assert all(frame.startswith("DP training") for frame in frames), [f for f in frames if "DP training" not in f]
    if epochs > 1:
        assert any(frame.startswith(f"DP training epoch {epochs}/{epochs}:") for frame in frames)
