module kube-fence/testenv/pause

go 1.24
