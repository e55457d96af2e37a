from factory.viewer.cli import main

main()
