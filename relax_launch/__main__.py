from relax_launch.cli import main

main()
