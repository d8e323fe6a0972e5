from ckptverify.cli import main

main()
