"""What every parallelism uses on a rank, whatever launched it: where tensors live (placement), what memory a rank
holds, the registry of what a rank keeps between cells, device rules, torch version differences (compat).
Rank side only: see ranks/."""
