"""The distributed discrete Gaussian mechanism (DDGauss): strategy, client, options and spec."""
