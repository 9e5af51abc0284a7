"""The DMM committees' sum as a SecureSum: its wire names, the committee's
custody, worker folds, reply checks and the round's state."""
