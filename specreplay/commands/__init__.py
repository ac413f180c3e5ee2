"""One module per `specreplay` verb; each imports its stage inside the command body."""
