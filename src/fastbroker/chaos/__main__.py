from fastbroker.chaos.cli import main

main(prog_name="python -m fastbroker.chaos")
