"""The mesh and what runs over it: the rules table, the expert all-to-all, the pipeline schedules."""
