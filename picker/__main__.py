from picker.cli.main import main

main()
