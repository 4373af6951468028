"""The datasets: one module per dataset (how its samples and labels are read from disk), the base class
they share and the readability check (:mod:`.base`), sparse labels and label counts (:mod:`.labels`). Pure
data: no loader, sampler or training logic."""
