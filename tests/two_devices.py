"""``fairseq-train`` on a machine that reports two CUDA devices, run on CPU (``--cpu --distributed-backend
gloo``): fairseq's single-node launch counts devices (``torch.multiprocessing.spawn`` of
``min(device_count, --distributed-world-size)`` workers; ``rank % device_count`` under torchrun's
``env://``), so with the count reported its real multi-GPU code paths run here. Spawned workers import
this file again (as ``__mp_main__``), so they report the same devices."""
import sys

import torch

torch.cuda.device_count = lambda: 2
torch.cuda.set_device = lambda device: None  # fairseq sets the device of a rank > 0 even with --cpu

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    sys.argv[0] = "fairseq-train"
    cli_main()
