"""The methods: one module or package per strategy; no method imports another."""
