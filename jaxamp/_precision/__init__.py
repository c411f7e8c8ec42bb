"""The precision policy and the loss scales: what dtype each param, activation and output
has, and the fp16 loss scale."""
