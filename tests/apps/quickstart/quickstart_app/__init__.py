"""quickstart-app: a Flower app in the style of Flower's PyTorch quickstart."""
