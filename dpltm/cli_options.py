"""The `dpltm` command line's options, declared once each (typer's `Annotated` aliases), so the
command functions in dpltm.cli only parse, call one stage, and print. `--help`'s defaults that fall
through to the config are read from configs/defaults.yaml (`cfg`) without importing torch."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any

import typer

from dpltm.choices import (
    Accountant,
    Activation,
    Arch,
    Dataset,
    Logger,
    Neighbouring,
    Noise,
    Optimizer,
    OutputLayer,
    Part,
    Recipe,
    Rewind,
    RunRecipe,
    SelectionRuleName,
    Split,
    Strategy,
    ThreatModel,
)
from dpltm.stages.select import TicketChoice, TicketSource

MAX_SEED = 2**63 - 1  # seeds fit torch's and numpy's generators (config.MAX_SEED, without importing torch)


@functools.cache
def _defaults_yaml() -> dict[str, Any]:
    """configs/defaults.yaml, read without importing the config machinery (it loads torch)."""
    from importlib import resources

    import yaml

    return yaml.safe_load((resources.files("dpltm.configs") / "defaults.yaml").read_text("utf-8")) or {}


def cfg(dotted: str, shown: str | None = None) -> str:
    """The effective default of an option that falls through to the config, for `--help`:
    defaults.yaml's value, marked as the config's (a dataset's yaml or --config may override it)."""
    if shown is None:
        node: Any = _defaults_yaml()
        for part in dotted.split("."):
            node = node[part]
        shown = "none" if node is None else ",".join(map(str, node)) if isinstance(node, list) else str(node)
    return f"{shown} from config"


DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Data root (else $DPLTM_DATA_DIR, else ../shared/data).",
    ),
]


Download = Annotated[
    bool,
    typer.Option(
        "--download",
        help=("First fetch missing official files of the datasets used into the data root: mnist, fashion-mnist "
              "and kmnist, md5-checked, through torchvision's dataset classes (pip install 'dpltm\\[download]'); "
              "har, isolet and digits must already be there."),
    ),
]


ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="YAML file overriding configs/defaults.yaml.",
    ),
]


Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto, cpu, cuda or cuda:N.",
    ),
]


ArchOption = Annotated[
    Arch | None,
    typer.Option(
        "--arch",
        help=("Network: mlp (LeNet-300-100 by default; the paper's), lenet5 (two 5×5 convolutions with 6 and 16 "
              "maps, each followed by the activation and 2×2 average pooling, then --hidden, default 120,84; "
              "masks on convolution and linear weights; 28×28 images) or dp-cnn (the DP-SGD benchmarks' small "
              "CNN: 16 8×8/2 and 32 4×4/2 convolutions with 2×2/1 max pooling, then --hidden, default 32; "
              "images of 14×14 or more), or a fixed ScatterNet front end (wavelet scattering, no weights, "
              "costs no privacy; features cached per record) with a head: scatter-linear (one linear layer), "
              "scatter-mlp (--hidden, default 100) or scatter-cnn (Tramèr & Boneh's small CNN)."),
        show_default="mlp",
    ),
]


ActivationOption = Annotated[
    Activation | None,
    typer.Option(
        help="Hidden activation: relu (paper) or tanh (bounded; helps under DP, Papernot et al. 2021).",
        show_default=cfg("model.activation"),
    ),
]


SplitOption = Annotated[
    Split | None,
    typer.Option(
        help=("Official split to draw from (train: the official training portion, the official test set as test "
              "set; test/all: a per-record 80/20 split of that pool)."),
        show_default=cfg("data.split"),
    ),
]


ValFraction = Annotated[
    float | None,
    typer.Option(
        help="Fraction of the training pool held out for validation.",
        show_default=cfg("data.val_fraction"),
    ),
]


PrivateDataset = Annotated[
    Dataset | None,
    typer.Option(
        help="Private dataset to train on (or the --config file's data.dataset).",
        show_default="mnist",
    ),
]


Sigma = Annotated[
    float | None,
    typer.Option(
        help="Noise multiplier σ (skips calibration; ε is reported).",
    ),
]


DeltaOption = Annotated[
    float | None,
    typer.Option(
        help="δ (paper: 1e-5).",
        show_default=cfg("train.delta"),
    ),
]


Epochs = Annotated[
    int | None,
    typer.Option(
        help="Epochs (paper: 50).",
        show_default=cfg("train.epochs"),
    ),
]


BatchSize = Annotated[
    int | None,
    typer.Option(
        help="Expected batch size L (Poisson sampling, q = L/N).",
        show_default=cfg("train.batch_size"),
    ),
]


Clip = Annotated[
    float | None,
    typer.Option(
        help="Per-sample clipping norm C (paper: 1).",
        show_default=cfg("train.clip"),
    ),
]


LearningRate = Annotated[
    float | None,
    typer.Option(
        help="Learning rate (paper: 0.1).",
        show_default=cfg("train.lr"),
    ),
]


OptimizerOption = Annotated[
    Optimizer | None,
    typer.Option(
        help="sgd, or adam (NoisyAdam).",
        show_default=cfg("train.optimizer"),
    ),
]


Momentum = Annotated[
    float | None,
    typer.Option(
        help="SGD momentum on the privatized gradients, in [0, 1).",
        show_default=cfg("train.momentum"),
    ),
]


NoiseOption = Annotated[
    Noise | None,
    typer.Option(
        help=("Noise plug-in: gaussian, dpd (differentially private dropout; --sigma is its σ, accounted as 2σ) "
              "or shaped (needs --public-dataset)."),
        show_default=cfg("train.noise"),
    ),
]


AccountantOption = Annotated[
    Accountant | None,
    typer.Option(
        help="Privacy accountant: pld (tight numerical) or rdp.",
        show_default=cfg("train.accountant"),
    ),
]


NeighbouringOption = Annotated[
    Neighbouring | None,
    typer.Option(
        "--neighbouring",
        "--neighboring",
        help=("Neighbouring datasets ε is stated for: add-remove (one record added or removed; the number of "
              "training records N is treated as public, as Opacus and TF Privacy do) or replace-one (one record "
              "replaced, N fixed; a larger ε for the same run)."),
        show_default="add-remove",
    ),
]


Seed = Annotated[
    int | None,
    typer.Option(
        help="Seed for the data split and any fresh layer.",
        show_default=cfg("seed"),
    ),
]


Json = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print the final report as one JSON object on stdout.",
    ),
]


LoggerOption = Annotated[
    Logger,
    typer.Option(
        "--logger",
        help=("Lightning logger of the run's versioned folder (<log-dir>/<command>/<dataset>/version_N): csv, "
              "tensorboard (pip install 'dpltm\\[tensorboard]'), mlflow (pip install 'dpltm\\[mlflow]'; "
              "$MLFLOW_TRACKING_URI, else <log-dir>/mlflow.db) or none (run.json only, which `dpltm plot` reads)."),
    ),
]


LogDir = Annotated[
    Path | None,
    typer.Option(
        "--log-dir",
        help="Root of the run folders (else $DPLTM_LOG_DIR, else ./logs).",
    ),
]


CudaGraphs = Annotated[
    bool,
    typer.Option(
        "--cuda-graphs",
        help=("Replay each training step from CUDA graphs (one CUDA device): the same batches and updates without "
              "per-step kernel launches; DP batches are padded to a fixed capacity with zero-weight rows "
              "(overflow in extra chunks, noise once per step): the same mechanism."),
    ),
]


GenerateDataset = Annotated[
    Dataset | None,
    typer.Option(
        help="Dataset the tickets are made on.",
        show_default=cfg("data.dataset"),
    ),
]


GenerateRounds = Annotated[
    int | None,
    typer.Option(
        help="Pruning rounds T (ticket 0 is the dense network).",
        show_default=cfg("generate.rounds"),
    ),
]


GenerateRewindStep = Annotated[
    int | None,
    typer.Option(
        "--rewind-step",
        metavar="K",
        help=("Late rewinding (Frankle et al. 2020): rounds after the first rewind to the dense network's weights "
              "after K steps of round 0, not θ0, and train the remaining iterations; the tickets keep that iterate "
              "(train --rewind K starts there). 0: θ0 (the paper's)."),
        show_default=cfg("generate.rewind_step"),
    ),
]


GenerateIterations = Annotated[
    int | None,
    typer.Option(
        help="SGD iterations per ticket (paper: 5000).",
        show_default=cfg("generate.iterations"),
    ),
]


GenerateBatchSize = Annotated[
    int | None,
    typer.Option(
        help="Mini-batch size (paper: 400).",
        show_default=cfg("generate.batch_size"),
    ),
]


GenerateLr = Annotated[
    float | None,
    typer.Option(
        help="SGD learning rate (paper: 0.1).",
        show_default=cfg("generate.lr"),
    ),
]


GeneratePruneRates = Annotated[
    str | None,
    typer.Option(
        help="Fraction of survivors pruned per round: one value, or one per layer (paper: 0.3,0.3,0.2).",
        show_default=cfg("", "0.3 per layer, 0.2 for the output layer"),
    ),
]


GenerateMinDensity = Annotated[
    float | None,
    typer.Option(
        help="Stop before a ticket would keep less than this fraction of weights.",
        show_default=cfg("generate.min_density"),
    ),
]


GenerateHidden = Annotated[
    str | None,
    typer.Option(
        help="Hidden layer widths (paper: 300,100).",
        show_default=cfg("model.hidden"),
    ),
]


GenerateProjectTo = Annotated[
    int | None,
    typer.Option(
        "--project-to",
        help="Add an input projection layer to this width (paper §4.5.2 transfer).",
    ),
]


GenerateControls = Annotated[
    bool | None,
    typer.Option(
        "--controls/--no-controls",
        help="Also train the random-reinit and random-mask control tickets.",
        show_default=cfg("generate.controls"),
    ),
]


GenerateSeed = Annotated[
    int | None,
    typer.Option(
        help="Seed for θ0, data split and batch order.",
        show_default=cfg("seed"),
    ),
]


GeneratePrivate = Annotated[
    bool,
    typer.Option(
        "--private",
        help=("Make ONE ticket on the private data itself, with privacy: DP-SGD warm-up (the train: recipe), "
              "masks by magnitude of the DP weights, one σ calibrated so warm-up + the planned training meet "
              "--eps. Writes a ticket for `dpltm train --ticket` (no select)."),
    ),
]


GenerateEps = Annotated[
    float | None,
    typer.Option(
        "--eps",
        "--eps2",
        help="With --private: ε of the whole run (warm-up and training, composed by PLD).",
        show_default=cfg("train.eps2"),
    ),
]


GenerateDelta = Annotated[
    float | None,
    typer.Option(
        help="With --private: δ.",
        show_default=cfg("train.delta"),
    ),
]


GenerateWarmupEpochs = Annotated[
    int | None,
    typer.Option(
        help="With --private: DP-SGD epochs per warm-up round.",
        show_default=cfg("private_ticket.warmup_epochs"),
    ),
]


GenerateDensity = Annotated[
    float | None,
    typer.Option(
        help="With --private: fraction of weights the ticket keeps.",
        show_default=cfg("private_ticket.density"),
    ),
]


GenerateRewind = Annotated[
    Rewind | None,
    typer.Option(
        help="With --private: train from the masked warm-up weights (warmup) or from θ0 (init).",
        show_default=cfg("private_ticket.rewind"),
    ),
]


GenerateEpochs = Annotated[
    int | None,
    typer.Option(
        help="With --private: epochs of the ticket's DP training, planned now (σ covers them).",
        show_default=cfg("train.epochs"),
    ),
]


GenerateNoiseSeed = Annotated[
    int | None,
    typer.Option(
        "--noise-seed",
        min=0,
        max=MAX_SEED,
        help=("With --private: seed the noise and Poisson sampling (reproducible; DP only while the seed stays "
              "secret). Default: a fresh OS-CSPRNG seed, never stored."),
    ),
]


GenerateOut = Annotated[
    Path | None,
    typer.Option(
        help=("Ticket file (default checkpoints/<dataset>-tickets.pt; with --private <dataset>-private-ticket.pt)."),
    ),
]


GenerateOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an existing ticket file made with other settings.",
    ),
]


GenerateProgress = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Show progress bars.",
    ),
]


InspectPath = Annotated[
    Path,
    typer.Argument(
        help=("A ticket file (`dpltm generate`), a winner (`dpltm select`), a model (`dpltm train`), its export "
              "(.safetensors) or a library run (`make_private(...).save`)."),
    ),
]


PredictModel = Annotated[
    Path,
    typer.Option(
        help="A model: a `dpltm train` checkpoint or its `dpltm export` (.safetensors).",
    ),
]


PredictDataset = Annotated[
    Dataset | None,
    typer.Option(
        help="Dataset to predict on.",
        show_default="the one the model was trained on",
    ),
]


PredictSplit = Annotated[
    Split | None,
    typer.Option(
        help=("Official split to draw from, as in training (train: the official test set is the test set; "
              "test/all: a per-record 80/20 split of that pool)."),
        show_default="the model's own on its training dataset, else train",
    ),
]


PredictPart = Annotated[
    Part,
    typer.Option(
        help=("Which records: the test set, the validation hold-out or the training set (with the model's own "
              "data settings when the dataset is its training dataset)."),
    ),
]


PredictOut = Annotated[
    Path | None,
    typer.Option(
        help="Write the predictions here as CSV: index, label, prediction and one probability per class.",
    ),
]


PredictOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an existing --out file.",
    ),
]


PredictExposeTrainingRecords = Annotated[
    bool,
    typer.Option(
        "--expose-training-records",
        help=("Allow --part train on the model's own dataset: its output holds per-record labels and model "
              "outputs of the private training records, which are not differentially private."),
    ),
]


ExportModel = Annotated[
    Path,
    typer.Option(
        help="A `dpltm train` checkpoint, or a library run saved by `PrivateTraining.save`.",
    ),
]


ExportOut = Annotated[
    Path | None,
    typer.Option(
        help="The safetensors file.",
        show_default="the model's path with .safetensors",
    ),
]


ExportOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an existing file.",
    ),
]


PlotRuns = Annotated[
    list[Path],
    typer.Argument(
        help="Run folders (logs/<command>/<dataset>/version_N) or their run.json; several overlay.",
    ),
]


PlotOut = Annotated[
    Path | None,
    typer.Option(
        help="Figure file (.png, .pdf or .svg).",
        show_default="plot.png in the first run's folder",
    ),
]


PlotOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an existing --out file.",
    ),
]


DownloadDatasets = Annotated[
    list[Dataset],
    typer.Argument(
        help="Datasets to fetch (mnist, fashion-mnist, kmnist: through torchvision's dataset classes).",
    ),
]


DownloadMirror = Annotated[
    str | None,
    typer.Option(
        help=("URL base to fetch the official files from instead of torchvision's mirrors (else "
              "$DPLTM_DOWNLOAD_MIRROR)."),
    ),
]


SelectTickets = Annotated[
    Path | None,
    typer.Option(
        help="Ticket set (default: the newest in checkpoints/, named on screen).",
    ),
]


SelectEps1 = Annotated[
    float | None,
    typer.Option(
        help="Selection budget ε1 (paper: 0.1).",
        show_default=cfg("select.eps1"),
    ),
]


SelectNu = Annotated[
    float | None,
    typer.Option(
        help="Score weight ν in S = A·(1 − ν·C) (paper: 50).",
        show_default=cfg("select.nu"),
    ),
]


SelectRuleOption = Annotated[
    SelectionRuleName | None,
    typer.Option(
        "--rule",
        help=("Choose by a rule of dpltm/selection/rules.py by name (exponential: ε1-DP; best; noise-aware: needs "
              "--private-size; random: looks at no data). Default: exponential, or what --best/--noise-aware name."),
    ),
]


SelectBest = Annotated[
    bool,
    typer.Option(
        "--best",
        help=("Pick the best paper score S = A·(1 − ν·C) without privacy (for tickets from public data). Beware: "
              "at ν = 50 the factor is negative for every C > 0.02, so it always takes the sparsest ticket, "
              "whatever the noise; prefer --noise-aware."),
    ),
]


SelectNoiseAware = Annotated[
    bool,
    typer.Option(
        "--noise-aware",
        help=("Train every ticket (the dense network included) under the planned DP noise on the tickets' own "
              "public data and pick the best; spends no ε. Needs --private-size; the planned run is "
              "--eps/--sigma, --epochs, --batch-size and the config's train section."),
    ),
]


SelectHalving = Annotated[
    int | None,
    typer.Option(
        "--halving",
        metavar="RUNGS",
        help=("Successive halving in the noise-aware choice: after T/2^RUNGS, …, T/4, T/2 steps only the dense "
              "network and the better half of the tickets train on (5 candidates, 2 rungs: the cost of 3 full "
              "runs instead of 5). 0: every candidate trains all T steps."),
        show_default="the config's select.halving (0)",
    ),
]


SelectSearch = Annotated[
    str | None,
    typer.Option(
        "--search",
        metavar="DIM[,DIM…]",
        help=("What the noise-aware choice also tries for each ticket, each as a candidate of its own: start (θ0 "
              "and the ticket's public-trained weights), release (the final iterate and an EMA 0.999 with "
              "warm-up, scored on the same run), freeze (the first layer held at its public weights). A variant "
              "wins only if it beats the dense network as planned by two standard errors; `train` then runs the "
              "winner as chosen. A train: setting in the --config file (rewind/output_layer, ema/ema_warmup, "
              "freeze) fixes its dimension. none: search nothing."),
        show_default="the config's select.search (none)",
    ),
]


SelectPrivateSize = Annotated[
    int | None,
    typer.Option(
        "--private-size",
        help="N, the private training set's size (public), for --noise-aware's planned run.",
    ),
]


SelectEps2 = Annotated[
    float | None,
    typer.Option(
        "--eps",
        "--eps2",
        help="--noise-aware: the planned training budget ε2 (σ calibrated to it).",
        show_default=cfg("train.eps2"),
    ),
]


SelectSigma = Annotated[
    float | None,
    typer.Option(
        help="--noise-aware: the planned noise multiplier instead of --eps.",
    ),
]


SelectEpochs = Annotated[
    int | None,
    typer.Option(
        help="--noise-aware: the planned epochs.",
        show_default=cfg("train.epochs"),
    ),
]


SelectBatchSize = Annotated[
    int | None,
    typer.Option(
        help="--noise-aware: the planned expected batch size L.",
        show_default=cfg("train.batch_size"),
    ),
]


SelectDevice = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="--noise-aware: where the candidates train (auto, cpu, cuda or cuda:N; default auto).",
        show_default=False,
    ),
]


SelectDataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="--noise-aware: data root of the tickets' public data (else $DPLTM_DATA_DIR, else ../shared/data).",
    ),
]


SelectReselect = Annotated[
    bool,
    typer.Option(
        "--reselect",
        help=("Allow another exponential-mechanism draw from a ticket set already drawn from; the winner's ledger "
              "composes every draw."),
    ),
]


SelectSeed = Annotated[
    int | None,
    typer.Option(
        min=0,
        max=MAX_SEED,
        help="Seed the draw (reproducible, not secret); default: OS CSPRNG.",
    ),
]


SelectOut = Annotated[
    Path | None,
    typer.Option(
        help="Winner file (default checkpoints/<dataset>-winner.pt).",
    ),
]


SelectOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an existing winner file.",
    ),
]


SelectProgress = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Show progress bars.",
    ),
]


TrainTicket = Annotated[
    Path | None,
    typer.Option(
        help="Winning ticket from `dpltm select`.",
    ),
]


TrainEps2 = Annotated[
    float | None,
    typer.Option(
        "--eps",
        "--eps2",
        help=("Training budget ε (the paper's ε2); σ is calibrated to it. With a private ticket (generate "
              "--private): the whole run's ε, warm-up included (default: the ε the ticket was planned for)."),
        show_default=cfg("train.eps2"),
    ),
]


TrainRecipe = Annotated[
    Recipe,
    typer.Option(
        help=("Training recipe under --config and flags: paper (defaults.yaml; the default), tuned (chosen on "
              "public data for MNIST-sized sets: tanh, L = 1600, lr = 6/σ, EMA 0.999; configs/recipes/tuned.yaml)"
              ", scatter (chosen on public data: the ScatterNet front end and a linear head, --arch "
              "scatter-linear, L = 4096, momentum 0.9, lr = 1/σ, 40 epochs; configs/recipes/scatter.yaml) or cnn "
              "(LeNet-5's, chosen on public data: --arch lenet5, tanh, L = 1600, lr = 6/σ, the final iterate; "
              "configs/recipes/cnn.yaml)."),
    ),
]


TrainLrSigma = Annotated[
    float | None,
    typer.Option(
        "--lr-sigma",
        help=("Set a DP run's learning rate to this / σ, so an update's noise stays the same across budgets (the "
              "tuned recipe's rule; overrides --lr for DP runs)."),
    ),
]


TrainEma = Annotated[
    float | None,
    typer.Option(
        "--ema",
        metavar="DECAY",
        help=("Release and evaluate an exponential moving average of the iterates with this decay, e.g. 0.999 "
              "(post-processing: free). Default: the final iterate."),
    ),
]


TrainEmaWarmup = Annotated[
    bool | None,
    typer.Option(
        "--ema-warmup/--no-ema-warmup",
        help=("Warm the moving average up: decay_t = min(DECAY, (1 + t)/(10 + t)) (TensorFlow's rule), so the first "
              "iterates (a far-away start) do not keep a weight of DECAY^T. Needs --ema."),
        show_default="the recipe's",
    ),
]


TrainRewind = Annotated[
    str | None,
    typer.Option(
        "--rewind",
        metavar="init|public|K",
        help=("Where the ticket's weights start: θ0 (init, the paper's), the weights its public IMP round ended "
              "with (public), or K, the iterate K steps into public training its tickets rewound to (generate "
              "--rewind-step K, late rewinding). Public data adds nothing to ε; public starts are refused for "
              "tickets made on the private data."),
        show_default=cfg("train.rewind"),
    ),
]


TrainFreeze = Annotated[
    str | None,
    typer.Option(
        "--freeze",
        metavar="LAYER[,LAYER…]",
        help=("Layers held at their start weights and not trained (e.g. hidden.0, or conv.0,conv.1): no clipped "
              "gradient, no noise, no update. With --rewind public they keep what public data taught them "
              "(public knowledge: nothing added to ε)."),
        show_default=cfg("train.freeze"),
    ),
]


TrainOutputLayer = Annotated[
    OutputLayer | None,
    typer.Option(
        "--output-layer",
        help=("With --rewind public or K: θ0's output layer (reinit; the public one learned other classes) or the "
              "public-trained one (keep; same class count only)."),
        show_default=cfg("train.output_layer"),
    ),
]


TrainActivation = Annotated[
    Activation | None,
    typer.Option(
        help=("Activation of the network trained (a ticket's included): relu (paper) or tanh (bounded; helps "
              "under DP, Papernot et al. 2021)."),
        show_default=cfg("model.activation"),
    ),
]


TrainMaxEps = Annotated[
    float | None,
    typer.Option(
        "--max-eps",
        help="A cap: stop before the ε spent would exceed this (σ stays calibrated to --eps).",
    ),
]



TrainPatience = Annotated[
    int | None,
    typer.Option(
        help="Early-stop after this many epochs without validation gain.",
    ),
]


TrainDense = Annotated[
    bool,
    typer.Option(
        "--dense",
        help="DP-SGD baseline on the full network (no ticket).",
    ),
]


TrainNonPrivate = Annotated[
    bool,
    typer.Option(
        "--non-private",
        help="Train without privacy (baseline).",
    ),
]


TrainPublicTickets = Annotated[
    bool,
    typer.Option(
        "--public-tickets",
        help=("Assert the ticket's generation data is public even though it has the private dataset's name "
              "(checked record by record)."),
    ),
]


TrainPublicDataset = Annotated[
    Dataset | None,
    typer.Option(
        help="Public dataset for noise plug-ins that need one (shaped); never the private dataset.",
    ),
]


TrainPublicSplit = Annotated[
    Split | None,
    typer.Option(
        help="Split of --public-dataset whose training part is used [default: train].",
    ),
]



TrainNoiseSeed = Annotated[
    int | None,
    typer.Option(
        "--noise-seed",
        min=0,
        max=MAX_SEED,
        help=("Seed the noise and Poisson sampling (reproducible; DP only while the seed stays secret). Default: "
              "a fresh OS-CSPRNG seed, never stored."),
    ),
]


TrainDevices = Annotated[
    int,
    typer.Option(
        help=("DP training on this many devices per node (Lightning DDP: one process each; on CPU, gloo "
              "processes). Each rank Poisson-samples its shard of the records, the clipped sums are all-reduced "
              "and the noise is added once: the same mechanism and ε as on one device."),
    ),
]


TrainNumNodes = Annotated[
    int,
    typer.Option(
        "--num-nodes",
        help=("Nodes of a multi-device run (launch one command per node with NODE_RANK, MASTER_ADDR and "
              "MASTER_PORT set, as Lightning documents)."),
    ),
]


TrainStrategy = Annotated[
    Strategy,
    typer.Option(
        help="auto, or ddp (what auto picks for more than one process).",
    ),
]


TrainOut = Annotated[
    Path | None,
    typer.Option(
        help="Model checkpoint (default checkpoints/<dataset>-<mode>.pt).",
    ),
]


TrainOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an existing model file.",
    ),
]


TrainProgress = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Show progress bars.",
    ),
]


AuditTicket = Annotated[
    Path | None,
    typer.Option(
        help="Winning ticket from `dpltm select` (as for `dpltm train`).",
    ),
]


AuditDense = Annotated[
    bool,
    typer.Option(
        "--dense",
        help="Audit DP-SGD on the full network (no ticket).",
    ),
]


AuditEps2 = Annotated[
    float | None,
    typer.Option(
        "--eps",
        "--eps2",
        help="Training budget ε; σ is calibrated to it (the claim the audit tests).",
        show_default=cfg("train.eps2"),
    ),
]


AuditRecipe = Annotated[
    Recipe,
    typer.Option(
        help="Training recipe, as for `dpltm train`.",
    ),
]


AuditCanaries = Annotated[
    int,
    typer.Option(
        help="Number m of canaries, each included with probability 1/2.",
    ),
]


AuditThreatModel = Annotated[
    ThreatModel,
    typer.Option(
        help=("white-box: Dirac gradient canaries on surviving weights, observed through the released noisy "
              "gradients (also reported: the final model only); black-box: out-of-distribution input records with "
              "random labels, scored by the released model's loss."),
    ),
]


AuditConfidence = Annotated[
    float,
    typer.Option(
        help="Confidence of the lower bound.",
    ),
]


AuditCanarySeed = Annotated[
    int | None,
    typer.Option(
        min=0,
        max=MAX_SEED,
        help="Seed the canaries and their inclusion bits (reproducible audits). Default: fresh OS randomness.",
    ),
]


AuditNoiseSeed = Annotated[
    int | None,
    typer.Option(
        "--noise-seed",
        min=0,
        max=MAX_SEED,
        help="Seed the noise and Poisson sampling. Default: a fresh OS-CSPRNG seed.",
    ),
]


AuditProgress = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Show progress bars.",
    ),
]


AccountQ = Annotated[
    float | None,
    typer.Option(
        "--q",
        help="Poisson sampling rate.",
    ),
]


AccountSigma = Annotated[
    float | None,
    typer.Option(
        help="Noise multiplier σ.",
    ),
]


AccountSteps = Annotated[
    int | None,
    typer.Option(
        help="Number of steps T.",
    ),
]


AccountDelta = Annotated[
    float,
    typer.Option(
        help="δ.",
    ),
]


AccountDatasetSize = Annotated[
    int | None,
    typer.Option(
        help="N (with --batch-size and --epochs instead of --q/--steps).",
    ),
]


AccountBatchSize = Annotated[
    int | None,
    typer.Option(
        help="Expected batch size L.",
    ),
]


AccountEpochs = Annotated[
    int | None,
    typer.Option(
        help="Epochs (⌈N/L⌉ steps each).",
    ),
]


AccountEps = Annotated[
    float | None,
    typer.Option(
        "--eps",
        "--eps2",
        help="Solve for σ reaching this ε instead.",
    ),
]


AccountEps1 = Annotated[
    float | None,
    typer.Option(
        help="Also compose with an ε1 exponential-mechanism selection.",
    ),
]


AccountNoise = Annotated[
    Noise,
    typer.Option(
        help=("Noise plug-in --sigma belongs to: gaussian, dpd (accounted as 2σ; adds the DPD paper's own zCDP "
              "figure as a labelled comparison) or shaped."),
    ),
]


RunDataset = Annotated[
    Dataset,
    typer.Option(
        help="Private dataset to train on.",
    ),
]


RunPublicDataset = Annotated[
    Dataset,
    typer.Option(
        help="Public dataset the tickets come from.",
    ),
]


RunPublicSplit = Annotated[
    Split,
    typer.Option(
        help="Split of the public dataset (KMNIST here: test).",
    ),
]


RunEps = Annotated[
    float,
    typer.Option(
        "--eps",
        "--eps2",
        help=("Privacy budget ε for the private data (all of it goes to training: public tickets cost nothing)."),
    ),
]


RunDelta = Annotated[
    float,
    typer.Option(
        help="δ.",
    ),
]


RunEpochs = Annotated[
    int | None,
    typer.Option(
        help="DP training epochs (paper: 50).",
    ),
]


RunBatchSize = Annotated[
    int | None,
    typer.Option(
        help="Expected DP batch size L (paper: 400).",
    ),
]


RunRounds = Annotated[
    int | None,
    typer.Option(
        help="Pruning rounds (paper-style default: 10).",
    ),
]


RunIterations = Annotated[
    int | None,
    typer.Option(
        help="SGD iterations per ticket (paper: 5000).",
    ),
]


RunProjectTo = Annotated[
    int | None,
    typer.Option(
        "--project-to",
        help=("Input projection width of the tickets (default: added automatically when the two datasets' input "
              "sizes differ)."),
    ),
]


RunActivation = Annotated[
    Activation | None,
    typer.Option(
        help=("Hidden activation of the tickets and the trained network: relu (paper) or tanh (bounded; helps "
              "under DP, Papernot et al. 2021)."),
        show_default="the recipe's",
    ),
]


RunMomentum = Annotated[
    float | None,
    typer.Option(
        help="SGD momentum on the privatized gradients, in [0, 1).",
        show_default="the recipe's",
    ),
]


RunEma = Annotated[
    float | None,
    typer.Option(
        "--ema",
        metavar="DECAY",
        help=("Release and evaluate an exponential moving average of the iterates with this decay, e.g. 0.999 "
              "(post-processing: free). Default: the final iterate."),
    ),
]


RunEmaWarmup = TrainEmaWarmup  # the same option on `run`


RunFreeze = Annotated[
    str | None,
    typer.Option(
        "--freeze",
        metavar="LAYER[,LAYER…]",
        help=("Layers of the winner held at their start weights and not trained (e.g. hidden.0); the noise-aware "
              "choice simulates the same. Public tickets only."),
        show_default=cfg("train.freeze"),
    ),
]


RunRewind = Annotated[
    str | None,
    typer.Option(
        "--rewind",
        metavar="init|public|K",
        help=("Where the winner's weights start for DP training: θ0 (init), the weights its public IMP round "
              "ended with (public), or K: the tickets are made with late rewinding to step K of public training "
              "and training starts there. Adds nothing to ε. Public tickets only."),
        show_default=cfg("train.rewind"),
    ),
]


RunOutputLayer = Annotated[
    OutputLayer | None,
    typer.Option(
        "--output-layer",
        help="With --rewind public or K: θ0's output layer (reinit) or the public-trained one (keep).",
        show_default=cfg("train.output_layer"),
    ),
]


RunRecipeOption = Annotated[
    RunRecipe,
    typer.Option(
        help=("Training recipe (under --config and flags): auto (the default: from 20000 training records, the "
              "size the recipes were chosen for, scatter where its front end applies — square images, public "
              "tickets of the same shape, no other --arch — else cnn for --arch lenet5 and tuned for the rest; "
              "paper below), scatter (the ScatterNet front end with tickets over a linear head, chosen on public "
              "data: L = 4096, momentum 0.9, lr = 1/σ, 5 IMP rounds of 1000 steps), tuned (chosen on public data: "
              "tanh, L = 1600, lr = 6/σ, EMA 0.999), cnn (LeNet-5's, chosen on public data: the tuned recipe's "
              "rate, the final iterate) or paper."),
    ),
]


RunTickets = Annotated[
    TicketSource,
    typer.Option(
        "--ticket-source",
        help=("Where the ticket comes from: public (generated without privacy on --public-dataset) or private "
              "(made on --dataset itself by DP warm-up, no public data needed; warm-up and training composed to "
              "--eps)."),
    ),
]



RunWarmupEpochs = Annotated[
    int | None,
    typer.Option(
        help="With --ticket-source private: DP warm-up epochs, taken out of --epochs.",
        show_default=cfg("private_ticket.warmup_epochs"),
    ),
]


RunDensity = Annotated[
    float | None,
    typer.Option(
        help="With --ticket-source private: fraction of weights the ticket keeps.",
        show_default=cfg("private_ticket.density"),
    ),
]


RunChoice = Annotated[
    TicketChoice,
    typer.Option(
        help=("How to pick the public ticket: noise-aware (train every ticket, the dense network included, under "
              "the planned DP noise on the public data; spends no ε) or best (the paper's score, which at ν = 50 "
              "always takes the sparsest ticket)."),
    ),
]


RunHalving = SelectHalving  # the same option on `run`


RunSearch = Annotated[
    str | None,
    typer.Option(
        "--search",
        metavar="DIM[,DIM…]",
        help=("What the noise-aware choice also tries for each ticket (start, release, freeze; none: nothing): "
              "see `dpltm select --help`. A setting you give (--rewind, --ema, --freeze) fixes its dimension."),
        show_default="start,release with --choice noise-aware",
    ),
]


RunSeed = Annotated[
    int | None,
    typer.Option(
        help="Seed.",
    ),
]


RunOut = Annotated[
    Path | None,
    typer.Option(
        help=("Model checkpoint (default checkpoints/<dataset>-dpltm.pt); the tickets and winner go beside it as "
              "<stem>-tickets.pt and <stem>-winner.pt."),
    ),
]


RunOverwrite = Annotated[
    bool,
    typer.Option(
        help="Replace existing outputs (finished tickets made with the same settings are reused).",
    ),
]


RunProgress = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Show progress bars.",
    ),
]
