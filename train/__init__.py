"""Training entry points (see the training issue); empty for now."""
