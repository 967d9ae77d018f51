from lilycli.cli import main

main()
