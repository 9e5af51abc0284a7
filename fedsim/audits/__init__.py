"""Privacy audits of trained federations: membership inference (loss, zlib, min-k%) with exact
ROC metrics, PII canaries (minority vs random), unlearning, post-hoc dataset inference, and
``fedsim audit`` for finished ``fedsim run`` directories."""
