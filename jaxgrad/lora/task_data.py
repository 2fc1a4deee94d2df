"""The training task's data from a local file or folder (:class:`LoraFit`'s ``data_path``): the records of
:func:`jaxgrad.lora.data.build_sft_data`, tokenized by the run's tokenizer, packed into rows of ``seq_len``."""

from __future__ import annotations

from jaxgrad.lora.data import build_sft_data
from jaxgrad.lora.task_config import LoraFit


class FileData:
    """``batches(epoch)``, ``batches_per_epoch``, ``eval_batches()`` and a one-line ``describe`` of the data
    (the same interface as the task's byte-level text). Without ``eval_path`` the held-out set is the seeded
    fraction ``held_out`` of the examples."""

    def __init__(self, fit: LoraFit, tokenizer):
        self.sft = build_sft_data(fit.data_path, tokenizer, seq_len=fit.seq_len, batch_size=fit.batch_size,
                                  held_out=0.0 if fit.eval_path is not None else fit.held_out, seed=fit.data_seed,
                                  packing=fit.packing, completion_only=fit.completion_only,
                                  assistant_only=fit.assistant_only, format=fit.data_format,
                                  eval_path=fit.eval_path, overlong=fit.overlong, pattern=fit.pattern,
                                  file_format=fit.file_format, sample_by=fit.sample_by)
        self.batches_per_epoch = self.sft.batches_per_epoch
        self.describe = f"{fit.data_path}: {self.sft.describe()}"
        self.stats = self.sft.stats.as_dict()

    def batches(self, epoch):
        return self.sft.batches(epoch)

    def eval_batches(self):
        return self.sft.eval_batches()
