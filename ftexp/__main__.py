from ftexp.cli import main

main()
