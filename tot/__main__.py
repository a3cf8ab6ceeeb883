from tot.solve import main

main()
