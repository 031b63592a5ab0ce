"""Tensor parallelism for the compute engine over torch.distributed (NCCL on GPUs, gloo on CPU).

- `group`: the process group, its timeouts and teardown;
- `shard`: which slice of every weight a rank holds (heads, KV heads, MLP columns) and the local spec;
- `lora_split`: the seed's LoRA partition rule over converted adapter rows;
- `schedule`: rank 0 drives, the other ranks follow each step's broadcast inputs;
- `alone`: rank 0's forwards without its peers (the warm-up's compile pass).
"""
