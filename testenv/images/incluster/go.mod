module kube-fence/testenv/incluster

go 1.24
