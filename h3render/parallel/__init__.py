"""Process groups, Ulysses sequence parallelism and the VAE work split (applied to finished models)."""
