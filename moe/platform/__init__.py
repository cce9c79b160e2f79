"""What the policy runs on: megatron-core release compatibility and CPU shims (`compat`,
`import_hooks`), process groups (`parallel`), child processes that die with their parent
(`children`), plain value checks (`checks`). Imports no other room of moe/."""
