"""The engine: sequences, page pool, scheduler, model runner, sampler and the loop tying them."""
