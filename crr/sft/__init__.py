"""The SFT warm start: the exploring expert's data and the synthetic curriculum, turned into token rows
(crr.sft.rows), and TRL's SFTTrainer on them (crr.sft.trainer); crr.sft.warm_start ties them into `crr sft`.

Nothing is imported here, so that `crr.sft.trainer` loads with torch, transformers and TRL alone (the SFT step
can then run by itself on a GPU node: `python -m crr.sft.trainer`)."""
