"""Expert routing as data: Routing Replay's cache and megatron-core hooks (`replay`), routing
volatility between two policies (`stats`), router scores past the top-k (`scores`), router-logit
noise on the selection (`noise`). Uses `moe.platform` only: the model room builds on it."""
