"""The diagnoses: the precision audit of a step's jaxpr, the overflow report of a step re-run
op by op, and the memory a step needs on a GPU, compiled without one."""
