from tot.solve import cli

cli()
