"""Where the teacher's components go, and whether they fit: the placement room.

Modules, lowest first (each imports only those above it; none imports `train/`):

* `devices`: the one `cuda:N` parser, memory sizes ("80GiB"), per-device allowances;
* `protocol`: what a strategy is given and answers with (`Need`, `LoadContext`, `Loaded`);
* `strategies`: the `Placement` classes (cpu, cuda, balanced / sequential, offloads);
* `devicemap`: explicit module maps and per-component device-map JSON files;
* `parse`: `--placement` / `--device` text to a strategy (what the recipe loader calls), and
  `auto`, a request to the planner, with the strategies it may pick;
* `inventory`: the machine a plan may use (detected, faked or described on the command line);
* `estimate`: weights from safetensors headers / meta models, activation formulas;
* `plan`: every strategy's need per phase on an inventory, and `auto`'s choice;
* `render`: the plan as rich tables;
* `load`: resolve a placement once, load a component with it, unload it;
* `oom`: out-of-memory errors that name the next strategy to try.
* `train_size`, `train_plan`, `train_inputs`: the memory plan for `train` (per-rank weights,
  gradients, AdamW, EMA, activations of each way to train a student; `plan --train`).

`devices`, `protocol`, `strategies`, `devicemap` and `parse` import nothing of
`teacher/` (the recipe, which `train/` reads, parses placements); the rest read teacher folders.
Nothing is imported here, so `import wandistill.placement.parse` stays as light as the recipe
needs.
"""
